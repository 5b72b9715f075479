"""Tree decoding over lean models: one shared prefix, a preallocated cache, rollback by index.

Used for the lean families (:mod:`gbv.engine.lean`, ``LEAN_ARCHITECTURES``); other architectures use
:class:`gbv.engine.decoder.Decoder`. One iteration (docs/ENGINE.md):

1. draft: the draft is fed the tokens it has not seen (the pending token, plus the last drafted token
   after a fully accepted block) as a chain, and samples the first token of K paths; then each depth
   runs one forward over the K current path tips, each tip attending the committed prefix and its own
   path only (a tree mask over one cache row: nothing is copied per path);
2. target: the K paths are merged into a trie (:mod:`gbv.engine.tree`); one forward scores every
   distinct node once over the shared prefix, and ``p`` (K, L+1, V) is gathered from the nodes;
3. verify with the method's verifier;
4. commit: the accepted path's cache slots are moved next to the prefix (a few slots per layer);
   everything after the committed length is dead and simply overwritten later.

Both caches hold the committed tokens but the pending one in slots ``0 .. len-1``; the draft may lag
one token behind (``draft_len``). The per-phase timers synchronise the device before reading the
clock; on CUDA they run only when ``profile`` is set, since each sync stalls the pipeline.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Collection, Sequence

import torch

from gbv.engine.decoder import AR, DecoderState, host_copies
from gbv.engine.lean import LeanCausalLM
from gbv.engine.sampling import SamplingConfig, draw_token, process_logits, sample_at, sample_into_at
from gbv.engine.static_sampling import MAX_CHAIN, draft_loop, draft_uniforms, plain_run_length, stop_token_array
from gbv.engine.static_steps import move
from gbv.engine.tree import build_tree, prefix_then
# Trie sizes through static steps are padded to a multiple of this many nodes (see step).
TREE_MULTIPLE = 8
# Room added to the prompt length when a cache is first allocated; it grows (doubling) when needed.
_INITIAL_ROOM = 512

_LEAN: "weakref.WeakKeyDictionary[torch.nn.Module, LeanCausalLM]" = weakref.WeakKeyDictionary()


def lean_model(model) -> LeanCausalLM:
    """The (cached) lean view of a Hugging Face model; it shares the model's weights."""
    lean = _LEAN.get(model)
    if lean is None:
        lean = _LEAN[model] = LeanCausalLM(model)
    return lean


_DRAFT_LEAN: "weakref.WeakKeyDictionary[torch.nn.Module, LeanCausalLM]" = weakref.WeakKeyDictionary()


def draft_lean_model(model, target) -> LeanCausalLM:
    """The lean view that drafts with ``model`` for ``target``: on the CPU, for a float32 draft whose
    products run on the compiled kernels, a view of its own whose matrices are rounded to bfloat16 values
    and streamed as bfloat16 panels (``LeanCausalLM.round_to_bf16_weights``: half the bytes a draft step
    reads; lossless, since the verifier is given the laws the drafts were drawn from); else the model's
    lean view (``lean_model``). ``GBV_DRAFT_BF16=0`` keeps the float32 draft. A model that is also the
    target keeps one view."""
    if model is target or os.environ.get("GBV_DRAFT_BF16", "1") == "0":
        return lean_model(model)
    draft = _DRAFT_LEAN.get(model)
    if draft is None:
        # One view built, not two: the shared view where it was built already, or where this one has
        # nothing to round (it becomes the shared view); else this one, rounded, the draft's own. (Before,
        # the shared view and then a copy to round: two builds, two forward choices.)
        # (built for rounding, bf16_draft: a view keeping its panels alone packs them as bfloat16 at once. Another
        # that cannot round has nothing rounded: it may serve as the shared view.)
        shared = _LEAN.get(model)
        draft = shared if shared is not None else LeanCausalLM(model, bf16_draft=True)
        if draft.can_round_to_bf16_weights():
            if draft is shared:
                draft = LeanCausalLM(model, bf16_draft=True)
            draft.round_to_bf16_weights()
        elif shared is None and not draft.panels_only:
            _LEAN[model] = draft
        _DRAFT_LEAN[model] = draft
    return draft


def draft_one_path(draft: LeanCausalLM, cache, tokens: list[int], draft_len: int, block: int, vocab: int,
                   config: SamplingConfig, rng, q_rows) -> list[int] | None:
    """One path of ``block`` tokens drafted on cache row 0 after the committed ``tokens`` (the draft has
    seen the first ``draft_len``), as ``block`` compiled calls of the draft's host forward (forward,
    softmax into ``q_rows`` ((block, V) float32 numpy, written in place), draw from ``rng.uniform()``),
    its tokens read back as host ints by the calls themselves: the unseen chain, then node i in slot
    ``len(tokens) - 1 + i``, at that position (a chain of one). None where those calls do not run here
    (no one-call forward, top-k / top-p), before anything is written or drawn. The single decoder's
    one-path drafting, and a batch's lone row's (``BatchTreeDecoder._draft_lone_path``). The ``block``
    calls run as one (``LeanCausalLM.sampled_path``: the same tokens and laws) where no sliding window
    binds on the way."""
    path = draft.sampled_path(tokens[draft_len:], draft_len, cache, vocab, config, rng, q_rows[:block], block)
    if path is not None:
        return path
    token = draft.sampled_chain(tokens[draft_len:], draft_len, cache, vocab, config, rng, q_rows[0])
    if token is None:
        return None
    committed = len(tokens) - 1
    path = [token]
    for i in range(1, block):
        path.append(draft.sampled_chain([path[-1]], committed + i, cache, vocab, config, rng, q_rows[i]))
    return path


class TreeDecoder(DecoderState):
    """The decoding state of one sequence over lean models; the same interface as ``Decoder``
    (``prefill``, ``step``, ``truncate``, ``tokens``, ``draft_len``, ``stats``)."""

    def __init__(self, target, draft, method: str, num_paths: int, block_len: int, vocab: int,
                 target_sampling: SamplingConfig, draft_sampling: SamplingConfig, seed: int, device,
                 profile: bool | None = None, stop_tokens: Collection[int] = ()) -> None:
        super().__init__(method, num_paths, block_len, vocab, target_sampling, draft_sampling, seed, device)
        # The tokens that end a generation (its EOS ids): a run of plain steps on the host ends at one
        # (plain_steps), where a step thrown away would cost a whole target step.
        self.stop_tokens = stop_token_array(stop_tokens)
        self.target = lean_model(target)
        self.draft = draft_lean_model(draft, target) if self.verifier is not None else None
        self.target_cache = None
        self.draft_cache = None
        self.profile = self.device.type == "cpu" if profile is None else profile

    # -------------------------------------------------------------------------------- helpers
    def _clock(self) -> float:
        """A clock reading after the device has finished the queued work (only when profiling)."""
        if self.profile and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _chain(self, model: LeanCausalLM, cache, ids: Sequence[int], start: int, static: bool = True):
        """Feed ``ids`` at slots (= positions) ``start ..``; the last position's logits (V',). ``static``:
        see :meth:`LeanCausalLM.chain` (False for a prompt)."""
        return model.chain(list(ids), start, cache, static=static)[0, -1, :self.vocab]

    # -------------------------------------------------------------------------------- decoding
    def _feed_prompt(self, head: list[int]) -> None:
        """Allocate both caches (prompt + room, growing later) and feed the prompt but its last token."""
        capacity = len(head) + 1 + _INITIAL_ROOM + self.num_paths * (self.block_len + 1)
        self.target_cache = self.target.new_cache(1, capacity, owner=self)
        if self.draft is not None:
            self.draft_cache = self.draft.new_cache(1, capacity, owner=self)
        if head:
            self._chain(self.target, self.target_cache, head, 0, static=False)
            if self.draft is not None and not self.defer_draft:
                self._chain(self.draft, self.draft_cache, head, 0, static=False)

    def catch_up_draft(self, upto: int) -> None:
        """Feed the draft, as one chain, the committed tokens it has not seen before position ``upto``
        (at most all but the pending one), after a deferred prefill. Timed as draft time, or as prefill
        time where it feeds the prompt (from slot 0: ``auto``'s deferred prefill of the draft), as a fixed
        row's draft is fed the prompt at the prefill, outside its tokens/s."""
        lag = self.tokens[self.draft_len:min(upto, len(self.tokens) - 1)]
        if self.draft is None or not lag:
            return
        prompt = self.draft_len == 0
        start = self._clock()
        self._chain(self.draft, self.draft_cache, lag, self.draft_len, static=not prompt)
        self.draft_len += len(lag)
        if prompt:
            self.stats.time_prefill += self._clock() - start
        else:
            self.stats.time_draft += self._clock() - start

    def _draft_one_path(self, block: int, committed: int, q: torch.Tensor) -> list[int] | None:
        """One path drafted as ``block`` compiled calls (:func:`draft_one_path`, q (1, L, V) written in
        place); None where those calls do not run here: :meth:`_draft_paths` then."""
        if self.draft.host_forward is None:  # (on a GPU: the tensor path)
            return None
        return draft_one_path(self.draft, self.draft_cache, self.tokens, self.draft_len, block, self.vocab,
                              self.draft_sampling, self.rng, q.numpy()[0])

    def _draft_paths(self, block: int, rows: int, committed: int, base: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K = ``rows`` paths: the unseen chain, then one forward per depth over the path tips. Returns
        the (K, L) drafted tokens and their laws q (K, L, V), on the device. Where the draft has static
        steps (CUDA graphs), the whole phase is one recorded call (:mod:`gbv.engine.static_sampling`); both
        forms draw from the same uniforms, taken before the phase."""
        config = self.draft_sampling
        lag = self.tokens[self.draft_len:]
        host_uniforms = self.draft.host_forward is not None
        if self.draft.steps is not None:
            if len(lag) > MAX_CHAIN:  # (a long lag, after a stretch of plain steps: all but its last first)
                self._chain(self.draft, self.draft_cache, lag[:-1], self.draft_len)
                lag = lag[-1:]
            loop = draft_loop(self.draft, self.draft_cache, len(lag), rows, block, self.vocab, config,
                              base + (block - 1) * rows)
            if loop is not None:
                q, drafted = loop(lag, base, self.rng, host_uniforms, self.draft_cache)
                return drafted, q
        uniforms = draft_uniforms(block, rows, config, self.rng, host_uniforms)
        q = torch.empty(rows, block, self.vocab, dtype=torch.float32, device=self.device)
        drafted = torch.empty(rows, block, dtype=torch.long, device=self.device)
        first = self._chain(self.draft, self.draft_cache, lag, base - len(lag))
        at = (lambda depth: None) if uniforms is None else (lambda depth: uniforms[depth])
        if rows == 1:
            drafted[:, 0] = sample_into_at(first[None], config, q[:, 0], at(0))
        else:
            q_first = process_logits(first, config)
            q[:, 0] = q_first
            drafted[:, 0] = sample_at(q_first.expand(rows, -1), at(0), config.greedy)
        if block > 1:
            # Node of path k at depth i (tokens x_1..x_{L-1}) sits in slot base + (i-1)*rows + k. One path
            # needs no mask: its tip attends every slot up to its own (a mask of all True only costs).
            mask = None
            if rows > 1:
                slot_path = torch.arange((block - 1) * rows, device=self.device) % rows
                own = slot_path[None, :] == torch.arange(rows, device=self.device)[:, None]
                mask = prefix_then(own, base)
            for i in range(1, block):
                width = base + i * rows
                tip_mask = None if mask is None else mask[..., :width]
                tips = self.draft.sampled_tips(drafted[:, i - 1], committed + i, base + (i - 1) * rows,
                                               self.draft_cache, tip_mask, self.vocab, config, at(i), q[:, i])
                if tips is None:
                    logits = self.draft.forward(drafted[:, i - 1][None], torch.full((1, rows), committed + i,
                                                device=self.device), base + (i - 1) * rows, self.draft_cache,
                                                tip_mask)
                    tips = sample_into_at(logits[0, :, :self.vocab], config, q[:, i], at(i))
                drafted[:, i] = tips
        return drafted, q

    def step(self, block_len: int | None = None) -> list[int]:
        """One iteration; returns the newly committed tokens (the last one is the new pending token).
        ``block_len`` (<= the configured one) shortens this iteration's block; 0 = a plain target step."""
        block, rows = self.iteration_shape(block_len)
        if block <= 0:
            if self.method == AR:  # plain decoding: a run of steps, where they run as one call (PlainLoop)
                return self.plain_steps(None if block_len is None else block_len + 1)
            return self._target_step()
        stats = self.stats
        committed = len(self.tokens) - 1  # slots of the committed prefix; the pending token goes next
        base = committed + 1  # first slot of the drafted nodes

        # 1. draft: the unseen chain, then one forward per depth over the K path tips.
        start = self._clock()
        path = None
        if rows == 1 and self.draft.host_forward is not None:
            q = torch.empty(1, block, self.vocab, dtype=torch.float32, device=self.device)
            path = self._draft_one_path(block, committed, q)
        if path is not None:
            drafted = torch.tensor([path], device=self.device)
        else:
            drafted, q = self._draft_paths(block, rows, committed, base)
        stats.draft_steps += block
        t_draft = self._clock()
        stats.time_draft += t_draft - start

        # 2. target: the trie of the paths in one forward over the shared prefix.
        p = paths = None
        if rows == 1 and path is None:
            # One path still on the device (CUDA graphs): its pass goes right after the drafting, the
            # drafts copied in on the device and read back with p, for the verifier (one wait, not two).
            p = self.target.sampled_probs_after(self.tokens[-1], drafted[0], committed, self.target_cache,
                                                self.vocab, self.target_sampling)
        if p is None:
            # the one read of the drafts (the trie is built on the host); one path was read as it was drawn
            paths = [path] if path is not None else drafted.tolist()
            if self.verify_on_host:  # the verifier reads the drafts on the host: build them there, not copy back
                drafted = torch.tensor(paths)
        if rows == 1:
            # One path is a chain: node i (depth i) in slot committed + i, the causal rule its mask, p its
            # logits as they come (building the trie and its mask cost ~0.2 ms here, for nothing).
            path_nodes = [list(range(block + 1))]
            if p is None:
                chain = [self.tokens[-1], *paths[0]]
                p = self.target.sampled_probs(chain, None, committed, self.target_cache, None, self.vocab,
                                              self.target_sampling)  # (one compiled call where the kernels run)
                if p is None:
                    logits = self.target.chain(chain, committed, self.target_cache, last_only=False)
                    p = process_logits(logits[0, :, :self.vocab], self.target_sampling)
            p = p[None]  # (1, L+1, V)
            num_nodes = block + 1
        else:
            # Through static steps (CUDA graphs) the trie is padded to a multiple of TREE_MULTIPLE nodes: a
            # recorded pass per trie size (9 to 25 nodes at K = 3, L = 8) cost a recording each, and a
            # pass costs about the same from 5 to 25 nodes on the H200 (0.88 ms replayed).
            multiple = TREE_MULTIPLE if self.target.steps is not None else 1
            tree = build_tree(self.tokens[-1], paths, self.device, multiple)
            path_nodes = tree.path_nodes_list
            positions, mask = committed + tree.depth, prefix_then(tree.ancestors, committed)
            p_nodes = self.target.sampled_probs(tree.tokens, positions, committed, self.target_cache, mask,
                                                self.vocab, self.target_sampling)
            if p_nodes is None:
                logits = self.target.forward(tree.tokens[None], positions[None], committed, self.target_cache, mask)
                p_nodes = process_logits(logits[0, :, :self.vocab], self.target_sampling)
            p = p_nodes[tree.path_nodes]  # (K, L+1, V)
            num_nodes = tree.num_nodes
        stats.target_calls += 1
        stats.tree_calls += 1
        stats.tree_nodes += num_nodes
        t_target = self._clock()
        stats.time_target += t_target - t_draft

        # 3. verify.
        if paths is None and self.verify_on_host:
            drafted, q, p = host_copies(drafted, q, p)  # (the drafts with the laws: one wait)
        result = self.verify(drafted, q, p, t_target)
        path, tau = result.path, result.accepted_len
        if paths is None:
            paths = drafted.tolist()

        # 4. commit: move the accepted nodes next to the prefix (the root is already in place).
        new = paths[path][:tau] + [int(result.next_token)]
        self.tokens.extend(new)
        nodes = path_nodes[path][1:tau + 1]
        if any(node != depth for depth, node in enumerate(nodes, start=1)):
            move(self.target, self.target_cache, [committed + node for node in nodes], list(range(base, base + tau)))
        kept = min(tau, block - 1)  # the draft never ran on x_L
        if rows > 1 and kept > 0 and (path > 0 or kept > 1):
            move(self.draft, self.draft_cache, [base + i * rows + path for i in range(kept)],
                 list(range(base, base + kept)))
        self.draft_len = base + kept
        return new

    def plain_steps(self, limit: int | None) -> list[int]:
        """Up to ``limit`` (None: any number) plain target steps, at least one: a run of them as one
        call where the host forward or static steps run it (:func:`~gbv.engine.static_sampling.plain_run_length`),
        else one step. On the host a run ends at a token of ``stop_tokens``. Returns the newly committed
        tokens, as :meth:`step` does."""
        count = plain_run_length(self.target, limit)
        if count > 1:
            start = self._clock()
            position = len(self.tokens) - 1
            drawn = self.target.sampled_run(self.tokens[-1], position, count, self.target_cache, self.vocab,
                                            self.target_sampling, self.rng, self.stop_tokens)
            if drawn is not None:
                self.stats.target_calls += len(drawn)
                self.stats.time_target += self._clock() - start
                self.tokens.extend(drawn)
                return drawn
        return self._target_step()

    def _target_step(self) -> list[int]:
        start = self._clock()
        position = len(self.tokens) - 1
        token = self.target.sampled_chain(self.tokens[-1:], position, self.target_cache, self.vocab,
                                          self.target_sampling, self.rng)
        if token is None:
            logits = self._chain(self.target, self.target_cache, self.tokens[-1:], position)
            token = draw_token(logits, self.target_sampling, self.rng)
        self.stats.target_calls += 1
        self.stats.time_target += self._clock() - start
        self.tokens.append(token)
        return [token]

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` committed tokens (after an EOS / stop string / token limit).
        Rolling back is free: slots past the committed length are never attended."""
        if length >= len(self.tokens):
            return
        del self.tokens[length:]
        self.draft_len = min(self.draft_len, length - 1)
