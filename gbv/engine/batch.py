"""Many sequences at once on the lean tree engine: one draft forward per depth and one target forward
per iteration for all rows, each row with its own length, tree, method, sampling and generator.

Layout (both models): one preallocated cache of ``max_rows`` rows; the active rows are the leading
rows ``0 .. n-1`` (a finished row is replaced by the last one, so every forward works on views).
Row ``b`` keeps its committed tokens in slots ``0 .. len_b - 1``. An iteration writes its new nodes
for all rows from one common slot ``start = max_b len_b``; row ``b`` masks out its dead slots
``len_b .. start - 1``, and at commit its pending token and accepted nodes are moved down to
``len_b ..`` (a few slots per row, all rows in one indexed copy per layer). Positions are per row,
so a row's logits are those of its own sequence: the per-row law is exactly the single-sequence
one, whatever the neighbours (tests/engine/test_batch.py).

Where batched and single-sequence outputs can still differ: a matrix multiply over B rows may sum in
another order than over 1 row, so logits can differ in the last bits; sampled tokens then differ only
when a draw lands within that rounding of a boundary, and greedy ties are affected likewise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from gbv.engine.decoder import AR, host_copies, host_random, set_method, verifies_on_host
from gbv.engine.sampling import (SamplingConfig, draw_token, draw_tokens, process_logits, sample_at,
                                 sample_into_at)
from gbv.engine.static_sampling import draft_uniforms, plain_run_length
from gbv.engine.stats import GenerationStats
from gbv.engine.tree import TokenTree, build_tree, packed_to
from gbv.engine.tree_decoder import draft_lean_model, draft_one_path, lean_model
from gbv.verify import TorchRandom

_ROOM = 512


@dataclass
class BatchRow:
    """The state of one sequence of a batch (what :class:`~gbv.engine.tree_decoder.TreeDecoder`
    keeps for one sequence; the caches are the batch's)."""

    tokens: list[int]
    method: str
    num_paths: int
    block_len: int
    target_sampling: SamplingConfig
    draft_sampling: SamplingConfig
    generator: torch.Generator
    rng: TorchRandom
    verify_rng: TorchRandom  # the verifier's: rng, or a host generator where it runs on the host
    verifier: object = None
    draft_len: int = 0
    stats: GenerationStats = field(default=None)
    stop_tokens: np.ndarray | None = None  # its generation's EOS ids ((k,) int64): where a lone row's plain run ends


class BatchTreeDecoder:
    """Rows are added (prefilled) and removed between iterations; :meth:`step` advances the given rows
    by one iteration each, all in the same forwards."""

    @torch.inference_mode()
    def __init__(self, target, draft, vocab: int, device, max_rows: int) -> None:
        self.target = lean_model(target)
        self.draft = draft_lean_model(draft, target) if draft is not None else None
        self.vocab = vocab
        self.device = torch.device(device)
        self.max_rows = max_rows
        self.verify_on_host = verifies_on_host(self.device)  # each row's verifier then has a host generator
        self.rows: list[BatchRow] = []
        self.target_cache = self.target.new_cache(max_rows, _ROOM, owner=self)
        self.draft_cache = self.draft.new_cache(max_rows, _ROOM, owner=self) if self.draft is not None else None

    # ------------------------------------------------------------------------------ rows
    @torch.inference_mode()
    def add_row(self, prompt_ids: list[int], method: str, num_paths: int, block_len: int,
                target_sampling: SamplingConfig, draft_sampling: SamplingConfig, seed: int) -> BatchRow:
        """Prefill a new row (every prompt token but the last) and return it."""
        if len(self.rows) >= self.max_rows:
            raise ValueError(f"the batch is full ({self.max_rows} rows)")
        if method != AR and self.draft is None:
            raise ValueError(f"method {method!r} needs a draft model")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        rng = TorchRandom(generator)
        row = BatchRow(tokens=list(prompt_ids), method=method, num_paths=num_paths, block_len=block_len,
                       target_sampling=target_sampling, draft_sampling=draft_sampling, generator=generator,
                       rng=rng, verify_rng=host_random(seed) if self.verify_on_host else rng)
        set_method(row, method, num_paths, block_len)
        row.stats = GenerationStats(method=method, num_paths=row.num_paths, block_len=row.block_len,
                                    depth_accept_counts=[0] * row.block_len, prompt_tokens=len(row.tokens))
        index = len(self.rows)
        head = row.tokens[:-1]
        need = len(row.tokens) + (row.num_paths + 1) * (row.block_len + 2)
        for model, cache in ((self.target, self.target_cache), (self.draft, self.draft_cache)):
            if model is None:
                continue
            if cache.capacity < need:
                cache.grow(need)
            if head:
                # (eagerly, as one sequence's prompt: on CUDA a graph per prompt length and row, met once, was
                # recorded, ~7 ms each, and filled the cache's MAX_STEPS_PER_CACHE, leaving later steps unrecorded)
                model.forward(torch.tensor([head], device=self.device), torch.arange(len(head), device=self.device)[None],
                              0, cache, None, causal=True, last_only=True, first_row=index, static=False)
        row.draft_len = len(head)
        self.rows.append(row)
        return row

    @torch.inference_mode()
    def remove_row(self, row: BatchRow) -> None:
        """Drop ``row``; the last row moves into its cache slot."""
        index = self.rows.index(row)
        last = len(self.rows) - 1
        if index != last:
            moved = self.rows[last]
            self.target_cache.copy_row(last, index, len(moved.tokens) - 1)
            if self.draft_cache is not None:
                self.draft_cache.copy_row(last, index, moved.draft_len)
            self.rows[index] = moved
        self.rows.pop()

    def remove_all_rows(self) -> None:
        """Drop every row at once, moving no cache row (after a step that failed halfway, nothing in
        the caches is kept); the caches stay allocated, and the next row is prefilled into row 0."""
        self.rows.clear()

    @torch.inference_mode()
    def catch_up_drafts(self, rows: list[BatchRow]) -> None:
        """Feed the draft of each of ``rows`` the tokens it has not seen, all but the pending one, in
        its own cache row (as :meth:`add_row` prefills): what plain steps (``auto``'s ``ar``) left it.
        Why apart from :meth:`step`: ``auto`` times it as the cost of switching to speculation, not as
        the speculative arm's own (a first trial charged with ~30 tokens of catch-up per row rated
        every arm below ``ar`` for good: ``AutoPolicy.ceiling``), as ``AutoDecoder`` does for one
        sequence (``TreeDecoder.catch_up_draft``)."""
        for row in rows:
            upto = len(row.tokens) - 1
            if self.draft is None or upto - row.draft_len < 2:
                continue
            chain = row.tokens[row.draft_len:upto]
            # (eagerly: on CUDA a graph per lag and row would be recorded for calls met once or twice)
            self.draft.forward(torch.tensor([chain], device=self.device),
                               torch.arange(row.draft_len, upto, device=self.device)[None], row.draft_len,
                               self.draft_cache, None, causal=True, last_only=True, first_row=self.rows.index(row),
                               static=False)
            row.draft_len = upto

    def _draft_lone_path(self, row: BatchRow, block: int) -> tuple[list[int], Tensor] | None:
        """The one path of a batch's only row as one sequence drafts it (:func:`draft_one_path`: the
        unseen chain and each depth as one compiled call of the draft's host forward on cache row 0).
        Returns (the path, q (1, block, V)), or None where those calls do not run
        (then :meth:`step` drafts as for many rows). For one row the batch's slots are the single
        decoder's (the chain from the draft length, node i in slot ``len(tokens) - 1 + i``), and the
        draws take the row's uniforms in the same order, so the tokens are those of :meth:`step`'s
        general form. Why: a lone row (``gbv serve`` at concurrency 1, the tail of a batch) ran at
        0.78x the single-sequence decoder, in the per-depth masks and torch calls of that form."""
        if self.draft is None or self.draft.host_forward is None:
            return None
        q = torch.empty(1, block, self.vocab, dtype=torch.float32)
        path = draft_one_path(self.draft, self.draft_cache, row.tokens, row.draft_len, block, self.vocab,
                              row.draft_sampling, row.rng, q.numpy()[0])
        return None if path is None else (path, q)

    def _lone_row_pass(self, row: BatchRow, block: int, lone: tuple[list[int], Tensor] | None,
                       plain_limit: int = 1) -> list[int] | None:
        """The target's pass, the verification and the commit of a batch's only row as one sequence runs them
        (:class:`~gbv.engine.tree_decoder.TreeDecoder`): the pass as one compiled call of the target's host
        forward on cache row 0, with the draw of a plain step (``block`` 0; as a run of up to ``plain_limit``
        steps, as :meth:`TreeDecoder.plain_steps` runs them, ending at the row's ``stop_tokens``) or the laws
        ``p`` of the pending token and the path ``lone`` (:meth:`_draft_lone_path`'s path and q) for the
        verifier. For one row the batch's slots are the single decoder's and nothing moves at the commit (the
        accepted nodes are already in place), so the row commits the tokens it would commit alone, bit for bit. Returns the new tokens, or
        None where that call does not run here (no host forward, top-k or top-p), before anything is written
        or drawn: :meth:`step` then runs its general form. Why: through that form's masks, numpy inputs and
        torch softmax and draw, a lone row (``gbv serve`` at concurrency 1, a batch's tail) ran at 0.72x the
        single decoder with ``ar`` and 0.86x with BV L = 4 in bfloat16 (scripts/bench_lone_row_pass.py)."""
        if self.target.host_forward is None:
            return None
        committed, stats = len(row.tokens) - 1, row.stats
        if block == 0:
            count = plain_run_length(self.target, plain_limit)
            if count > 1:
                drawn = self.target.sampled_run(row.tokens[-1], committed, count, self.target_cache, self.vocab,
                                                row.target_sampling, row.rng, row.stop_tokens)
                if drawn is not None:
                    stats.target_calls += len(drawn)
                    row.tokens.extend(drawn)
                    return drawn
            token = self.target.sampled_chain(row.tokens[-1:], committed, self.target_cache, self.vocab,
                                              row.target_sampling, row.rng)
            if token is None:
                return None
            stats.target_calls += 1
            row.tokens.append(token)
            return [token]
        path, q = lone
        p = self.target.sampled_probs([row.tokens[-1], *path], None, committed, self.target_cache, None, self.vocab,
                                      row.target_sampling)
        if p is None:
            return None
        result = row.verifier(torch.tensor([path]), q, p[None], row.verify_rng)
        tau = result.accepted_len
        stats.target_calls += 1
        stats.draft_steps += block
        stats.tree_calls += 1
        stats.tree_nodes += block + 1
        stats.record_accept(tau)
        row.draft_len = committed + 1 + min(tau, block - 1)  # (the draft never ran on the path's last token)
        new = path[:tau] + [int(result.next_token)]
        row.tokens.extend(new)
        return new

    # ------------------------------------------------------------------------------ one iteration
    @torch.inference_mode()
    def step(self, blocks: dict[int, int], plain_limits: dict[int, int] | None = None) -> dict[int, list[int]]:
        """Advance the rows ``id(row) -> block`` (block <= the row's block_len; 0 = a plain target step)
        by one iteration; returns ``id(row) -> newly committed tokens``. Rows not named wait.
        ``plain_limits``: ``id(row) ->`` how many plain steps the row may take (its cap, as the row loop
        sets it); a lone row takes a plain step as a run of up to that many (``_lone_row_pass``), the
        others one."""
        rows = self.rows
        n = len(rows)
        block = [min(blocks[id(r)], r.block_len) if id(r) in blocks else -1 for r in rows]
        drafting = [b > 0 for b in block]
        lens = [len(r.tokens) - 1 for r in rows]  # committed slots of each row
        dev = self.device

        # 1. draft: the unseen chain, then the K tips of every drafting row, depth by depth.
        width = max([r.num_paths if not r.draft_sampling.greedy else 1 for r, d in zip(rows, drafting) if d],
                    default=0)
        depth_max = max([b for b, d in zip(block, drafting) if d], default=0)
        drafted = torch.zeros(n, max(width, 1), max(depth_max, 1), dtype=torch.long, device=dev)
        qs: list[Tensor | None] = [None] * n
        tips_k = [0] * n  # paths drafted per row
        uniforms: list[Tensor | None] = [None] * n  # each drafting row's (block, k, 1), None when greedy
        host_uniforms = self.draft is not None and self.draft.host_forward is not None
        chain_moves: list[tuple[int, list[int], list[int]]] = []
        tip_base = 0
        lone = self._draft_lone_path(rows[0], block[0]) if n == 1 and width == 1 and depth_max > 0 else None
        if lone is not None:
            drafted[0, 0, :block[0]] = torch.tensor(lone[0], device=dev)
            qs[0], tips_k[0], tip_base = lone[1], 1, len(rows[0].tokens)
        elif depth_max > 0:
            chains = [r.tokens[r.draft_len:] if d else [] for r, d in zip(rows, drafting)]
            m_max = max(len(c) for c in chains)
            # Over all rows: a row that does not draft now must not get garbage below its draft length.
            d_start = max(r.draft_len for r in rows)
            draft_lens = torch.tensor([r.draft_len for r in rows], device=dev)
            chain_lens = torch.tensor([len(c) for c in chains], device=dev)
            ids = torch.zeros(n, m_max, dtype=torch.long)
            for b, chain in enumerate(chains):
                if chain:
                    ids[b, :len(chain)] = torch.tensor(chain)
                    chain_moves.append((b, list(range(d_start, d_start + len(chain))),
                                        list(range(rows[b].draft_len, rows[b].draft_len + len(chain)))))
            query = torch.arange(m_max, device=dev)
            slots = torch.arange(d_start + m_max, device=dev)
            valid = query[None, :, None] < chain_lens[:, None, None]  # (n, m, 1): a real chain token
            seen = (slots[None, None, :] < draft_lens[:, None, None]) | (
                (slots >= d_start) & (slots - d_start <= query[:, None]))[None]
            mask = (seen & valid) | (slots == d_start + query[:, None])[None]  # padding sees itself only
            pos = draft_lens[:, None] + query[None, :]
            logits = self.draft.forward(ids.to(dev), pos, d_start, self.draft_cache, mask[:, None])
            tip_base = d_start + m_max
            last = (chain_lens - 1).clamp_min(0)
            first = logits[torch.arange(n, device=dev), last, :self.vocab]
            # Where every drafting row draws one path under the same settings (BV, token-level
            # sampling, any greedy draft), each depth's draws for all rows are one call
            # (sample_into_at over (n, V) rows) rather than one a row: at 16 rows of BV L = 4 in
            # bfloat16 that took the step's host work from ~3.3 to ~2.85 ms of ~10 ms
            # (scripts/batch_step_split.py). Rows not drafting at a depth are drawn
            # too and their tokens ignored (their slots are masked, as the 0s were). The same
            # uniforms, taken row by row as before, and the same kernel: the same tokens.
            configs = {r.draft_sampling for r, d in zip(rows, drafting) if d}
            shared = next(iter(configs)) if width == 1 and len(configs) == 1 else None
            if shared is not None:
                q_all = torch.empty(n, depth_max, self.vocab, dtype=torch.float32, device=dev)
                u_all = None if shared.greedy else torch.full((depth_max, n, 1), 0.5, dtype=torch.float64,
                                                                 device=dev)
            for b, row in enumerate(rows):
                if not drafting[b]:
                    continue
                if shared is not None:
                    tips_k[b], qs[b] = 1, q_all[b:b + 1, :block[b]]
                    uniforms[b] = draft_uniforms(block[b], 1, shared, row.rng, host_uniforms)
                    if u_all is not None:
                        u_all[:block[b], b] = uniforms[b][:, 0]
                    continue
                k = 1 if row.draft_sampling.greedy else row.num_paths
                tips_k[b] = k
                qs[b] = torch.empty(k, block[b], self.vocab, dtype=torch.float32, device=dev)
                # the row's uniforms, taken as a single sequence takes them (TreeDecoder._draft_paths)
                uniforms[b] = draft_uniforms(block[b], k, row.draft_sampling, row.rng, host_uniforms)
                if k == 1:
                    drafted[b, :1, 0] = sample_into_at(first[b][None], row.draft_sampling, qs[b][:, 0],
                                                       _depth(uniforms[b], 0))
                    continue
                q_first = process_logits(first[b], row.draft_sampling)
                qs[b][:, 0] = q_first
                drafted[b, :k, 0] = sample_at(q_first.expand(k, -1), _depth(uniforms[b], 0), row.draft_sampling.greedy)
            if shared is not None:
                drafted[:, 0, 0] = sample_into_at(first, shared, q_all[:, 0], _depth(u_all, 0))
            # Tip k of a row at depth i sits in slot tip_base + (i-1)*width + k; it sees the row's
            # committed prefix, its chain, and its own path's earlier tips.
            path_of = torch.arange(width, device=dev)
            prefix = (slots[None, :] < draft_lens[:, None]) | (
                (slots[None, :] >= d_start) & (slots[None, :] < d_start + chain_lens[:, None]))  # (n, S0)
            lens_t = torch.tensor(lens, device=dev)
            blocks_t = torch.tensor(block, device=dev)
            drafting_t = torch.tensor(drafting, device=dev)
            for i in range(1, depth_max):
                start = tip_base + (i - 1) * width
                end = start + width
                tip_slots = torch.arange(tip_base, end, device=dev)
                own = ((tip_slots - tip_base) % width)[None, :] == path_of[:, None]  # (width, i*width)
                live = (blocks_t > i) & drafting_t  # rows drafting at this depth
                mask = torch.cat([prefix[:, None, :].expand(n, width, -1),
                                  own[None].expand(n, -1, -1)], dim=2) & live[:, None, None]
                mask[:, path_of, start + path_of] = True  # every query sees itself (idle rows too)
                # An idle row's queries are masked and ignored; position 0 keeps them inside the draft's
                # rotary table, which its committed length (grown by plain steps) may have passed.
                pos = torch.where(live, lens_t + i, 0)[:, None].expand(n, width)
                logits = self.draft.forward(drafted[:, :, i - 1], pos, start, self.draft_cache, mask[:, None])
                if shared is not None:
                    drafted[:, 0, i] = sample_into_at(logits[:, 0, :self.vocab], shared, q_all[:, i], _depth(u_all, i))
                    continue
                for b, row in enumerate(rows):
                    if not drafting[b] or block[b] <= i:
                        continue
                    k = tips_k[b]
                    drafted[b, :k, i] = sample_into_at(logits[b, :k, :self.vocab], row.draft_sampling, qs[b][:, i],
                                                       _depth(uniforms[b], i))
        if n == 1 and (lone is not None or block[0] == 0):
            new = self._lone_row_pass(rows[0], block[0], lone, (plain_limits or {}).get(id(rows[0]), 1))
            if new is not None:
                return {id(rows[0]): new}
        drafted_host = drafted.tolist()  # the one read of the drafts: the tries are built on the host

        # 2. target: every drafting row's trie, a lone root for a plain step, in one forward. The inputs
        # are built on the host with numpy and handed over at once (views on the CPU, one copy
        # elsewhere: tree.packed_to, with the tries' path nodes). Why: as torch ops, four a row and a
        # trie's tensors each, they took a 16-row `ar` step's host work (bfloat16) from 0.41 to
        # 0.67-0.70 ms of ~2.5 ms (scripts/batch_step_split.py).
        trees: list[TokenTree | None] = [None] * n  # (drafting rows only)
        for b in range(n):
            if drafting[b]:
                trees[b] = build_tree(rows[b].tokens[-1], [p[:block[b]] for p in drafted_host[b][:tips_k[b]]])
        n_nodes = max([t.num_nodes for t in trees if t is not None], default=1)
        t_start = max(lens)
        ids = np.zeros((n, n_nodes), dtype=np.int64)
        pos = np.zeros((n, n_nodes), dtype=np.int64)
        mask = np.zeros((n, 1, n_nodes, t_start + n_nodes), dtype=bool)
        mask[:, 0, np.arange(n_nodes), t_start + np.arange(n_nodes)] = True
        for b, tree in enumerate(trees):
            if tree is not None:
                m = tree.num_nodes
                ids[b, :m] = tree.tokens.numpy()
                pos[b, :m] = lens[b] + tree.depth.numpy()
                mask[b, 0, :m, :lens[b]] = True
                mask[b, 0, :m, t_start:t_start + m] = tree.ancestors.numpy()
            elif block[b] == 0:
                ids[b, 0], pos[b, 0] = rows[b].tokens[-1], lens[b]
                mask[b, 0, 0, :lens[b]] = True
        multi = [b for b in range(n) if tips_k[b] > 1]  # (rows of one path index p by a slice)
        handed = [torch.from_numpy(a) for a in (ids, pos, mask)] if dev.type == "cpu" else \
            packed_to((ids, pos, mask, *(trees[b].path_nodes.numpy() for b in multi)), dev)
        for b, path_nodes in zip(multi, handed[3:]):
            trees[b].path_nodes = path_nodes
        logits = self.target.forward(handed[0], handed[1], t_start, self.target_cache, handed[2])

        # 3. verify each row, 4. commit: collect every row's slot moves, then one copy per layer.
        out: dict[int, list[int]] = {}
        t_moves: tuple[list[int], list[int], list[int]] = ([], [], [])
        d_moves: tuple[list[int], list[int], list[int]] = ([], [], [])
        for b, src, dst in chain_moves:
            _extend(d_moves, b, src, dst)

        # Where every verifying row samples the target the same way, p of all rows' nodes is one
        # process_logits call (one compiled softmax on the CPU) rather than one a row, and a row of one
        # path (a chain: nodes 0..L) takes its rows as a view: ~0.2 ms less host work a step at 16 rows
        # of BV L = 4 (bfloat16). (Padding nodes of shorter tries are finite rows, ignored.)
        verifying = [b for b in range(n) if drafting[b]]
        target_configs = {rows[b].target_sampling for b in verifying}
        p_all = (process_logits(logits[:, :, :self.vocab], next(iter(target_configs)))
                 if len(verifying) > 1 and len(target_configs) == 1 else None)

        def verify_inputs(b: int) -> tuple[Tensor, Tensor, Tensor]:
            """Row b's (K, L) drafts, (K, L, V) q and (K, L+1, V) p."""
            tree = trees[b]
            if p_all is None:
                p_nodes = process_logits(logits[b, :tree.num_nodes, :self.vocab], rows[b].target_sampling)
            else:
                p_nodes = p_all[b]
            p = p_nodes[:block[b] + 1][None] if tips_k[b] == 1 else p_nodes[tree.path_nodes]
            return drafted[b, :tips_k[b], :block[b]], qs[b], p

        # Off the CPU (verifies_on_host) every verifying row's inputs are copied to the host in one read;
        # on the CPU each row takes its own when it comes (its slice of p_all, or its own softmax).
        on_host = verifying if self.verify_on_host else []
        copied: dict[int, tuple[Tensor, ...]] = {}
        if on_host:
            flat = host_copies(*(t for b in on_host for t in verify_inputs(b)))
            copied = {b: flat[3 * i:3 * i + 3] for i, b in enumerate(on_host)}
        # The plain rows' draws: one call for all where they sample alike (draw_tokens), else one a row.
        plain = [b for b in range(n) if block[b] == 0]
        plain_configs = {rows[b].target_sampling for b in plain}
        drawn = {}
        if len(plain) > 1 and len(plain_configs) == 1:
            drawn = dict(zip(plain, draw_tokens(logits[plain, 0, :self.vocab], plain_configs.pop(),
                                                [rows[b].rng for b in plain])))
        for b, (row, tree) in enumerate(zip(rows, trees)):
            if block[b] < 0:
                continue
            stats = row.stats
            stats.target_calls += 1
            if not drafting[b]:
                token = drawn[b] if drawn else draw_token(logits[b, 0, :self.vocab], row.target_sampling, row.rng)
                _extend(t_moves, b, [t_start], [lens[b]])
                row.tokens.append(token)
                out[id(row)] = [token]
                continue
            inputs = copied[b] if b in copied else verify_inputs(b)
            result = row.verifier(*inputs, row.verify_rng)
            path, tau = result.path, result.accepted_len
            stats.draft_steps += block[b]
            stats.tree_calls += 1
            stats.tree_nodes += tree.num_nodes
            stats.record_accept(tau)
            nodes = tree.path_nodes_list[path][:tau + 1]
            _extend(t_moves, b, [t_start + node for node in nodes], list(range(lens[b], lens[b] + tau + 1)))
            kept = min(tau, block[b] - 1)
            src = [tip_base + (i - 1) * width + path for i in range(1, kept + 1)]
            _extend(d_moves, b, src, list(range(lens[b] + 1, lens[b] + 1 + kept)))
            row.draft_len = lens[b] + 1 + kept
            new = drafted_host[b][path][:tau] + [int(result.next_token)]
            row.tokens.extend(new)
            out[id(row)] = new
        for cache, moves in ((self.target_cache, t_moves), (self.draft_cache, d_moves)):
            rows_idx, src, dst = moves
            if cache is not None and any(s != d for s, d in zip(src, dst)):
                cache.move(src, dst, rows_idx)
        return out

    def truncate(self, row: BatchRow, length: int) -> None:
        """Keep the first ``length`` tokens of ``row`` (rollback by index)."""
        if length < len(row.tokens):
            del row.tokens[length:]
            row.draft_len = min(row.draft_len, length - 1)


def _depth(uniforms: Tensor | None, depth: int) -> Tensor | None:
    """The uniforms of one drafting depth, (k, 1) (or (n, 1): every row's one path), or None (greedy)."""
    return None if uniforms is None else uniforms[depth]


def _extend(moves: tuple[list[int], list[int], list[int]], row: int, src: list[int], dst: list[int]) -> None:
    moves[0].extend([row] * len(src))
    moves[1].extend(src)
    moves[2].extend(dst)
