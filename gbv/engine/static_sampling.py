"""Static calls that also sample: one iteration's drafting as one call (:class:`DraftLoop`), and a
step that also computes its law and draws (:class:`SampledStep`). On CUDA each is one recorded graph.

Why: with each forward replayed as a graph (:mod:`gbv.engine.static_steps`), an iteration's drafting
on an H200 was still launched op by op from Python: per depth, the buffers of a step copied in, its
replay, the output copied out, the softmax and the inverse-CDF draw (about 25 torch calls a depth,
~117 an iteration of BV L = 4 outside the forwards; ``scripts/launch_counts.py``). A :class:`DraftLoop`
records the whole phase, the unseen chain, the first tokens and every depth's forward over the K path
tips with its law and its draws, so that one iteration's drafting launches a handful of calls: the
chain's ids and the first slot copied in, the uniforms drawn, one replay and the two outputs copied out.

It computes what :meth:`gbv.engine.tree_decoder.TreeDecoder._draft_paths` computes on the torch path:
the same forwards (those of a static step: every slot under a mask), the same laws
(:func:`gbv.engine.sampling.process_logits`) and the same draws from the same uniforms
(:func:`draft_uniforms`, drawn before the phase; :func:`gbv.verify.common.draw_rows_at`), so the
tokens are those of the step-by-step form (``tests/engine/test_static_sampling.py``).
"""

from __future__ import annotations

import os
from collections.abc import Collection

import numpy as np
import torch
from torch import Tensor

from gbv.engine.sampling import SamplingConfig, fill_token_uniform, process_logits
from gbv.engine.static_steps import MAX_QUERIES, Recorded, StaticStep, StaticSteps, iteration_steps, static_forward
from gbv.errors import GbvError
from gbv.verify.common import TorchRandom, draw_rows_at

# Unseen chains longer than this are fed first (all but their last token) as a chain of their own:
# a loop per chain length would be recorded for lags met once (after ``auto``'s ``ar`` stretches).
MAX_CHAIN = 4


def draft_uniforms(block: int, rows: int, config: SamplingConfig, rng: TorchRandom, host: bool,
                   out: Tensor | None = None) -> Tensor | None:
    """The uniforms of one iteration's draws, taken at once before drafting: (block, rows, 1) float64
    (depth i, path k: ``[i, k]``), into ``out`` when given; None when the draft is greedy. With
    ``host`` (a CPU generator whose drafting runs the host forward's compiled calls) from
    ``rng.uniforms``, its buffered block: a ``torch.rand`` after a forward costs tens of us from a cold
    cache there. Otherwise from one ``uniform_`` on the generator's device (nothing read back: on a
    GPU, no wait)."""
    if config.greedy:
        return None
    generator = rng.generator
    if host and generator.device.type == "cpu":
        drawn = torch.from_numpy(rng.uniforms(block * rows)).view(block, rows, 1)
        return drawn if out is None else out.copy_(drawn)
    if out is None:
        out = torch.empty((block, rows, 1), dtype=torch.float64, device=generator.device)
    return out.uniform_(generator=generator)


def draft_loop(lean, cache, chain: int, rows: int, block: int, vocab: int, config: SamplingConfig,
               end: int) -> "DraftLoop | None":
    """The loop of this shape over ``cache`` (made on first use), or None where drafting runs step by step:
    no static steps for ``lean``, a chain longer than :data:`MAX_CHAIN`, or the cache's steps full.
    ``end``: one past the last slot the phase writes (the cache grows to hold it)."""
    steps = iteration_steps(lean)
    if steps is None or not 1 <= chain <= MAX_CHAIN:
        return None
    return steps.kept(cache, ("draft", chain, rows, block, vocab, config), end,
                      lambda: DraftLoop(cache, chain, rows, block, vocab, config, steps))


class DraftLoop(Recorded):
    """The drafting of one iteration over one cache row: an unseen chain of ``chain`` tokens, then
    ``block - 1`` depths over ``rows`` path tips; laws under ``config`` over the first ``vocab`` logits.

    Slots (as in ``TreeDecoder``): the chain ends at slot ``base - 1`` (the pending token); path k's
    node at depth i (1 <= i < block) sits in slot ``base + (i - 1) * rows + k``, at position
    ``base - 1 + i``, and attends the prefix (slots < base) and its own path's earlier nodes."""

    def __init__(self, cache, chain: int, rows: int, block: int, vocab: int, config: SamplingConfig,
                 owner: StaticSteps) -> None:
        super().__init__(owner)
        lean = self.lean
        self.chain, self.rows, self.block, self.vocab, self.config = chain, rows, block, vocab, config
        capacity = cache.capacity
        lean.ensure_rotary(capacity)
        self.tables = lean._kind_tables  # (kept alive: the graph reads them; a regrowth makes a new dict)
        device = lean.device
        with torch.inference_mode(False):
            self.inputs = torch.zeros(chain + 1, dtype=torch.long, device=device)  # the chain's ids, then base
            self.uniforms = torch.zeros(block, rows, 1, dtype=torch.float64, device=device)
            self.columns = torch.arange(capacity, device=device)
            self.path_of = torch.arange(rows, device=device)
            self.chain_offsets = torch.arange(chain, device=device)

    def __call__(self, ids: list[int], base: int, rng: TorchRandom, host_uniforms: bool, cache
                 ) -> tuple[Tensor, Tensor]:
        """Draft from the unseen chain ``ids`` ending at slot ``base - 1``, the uniforms
        :func:`draft_uniforms` (``rng``, ``host_uniforms``) draws, straight into the loop's buffer.
        Returns new tensors: q (rows, block, vocab) float32, the laws drawn from, and the drafted
        tokens (rows, block) long."""
        inputs = torch.tensor([*ids, base], dtype=torch.long)  # (one copy to the device for all)
        with self.owner.lock:
            self.inputs.copy_(inputs)
            draft_uniforms(self.block, self.rows, self.config, rng, host_uniforms, out=self.uniforms)
            return self._replay(cache)

    def _forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, cache,
                 last_only: bool) -> Tensor:
        """:func:`static_forward` of one row's (N,) ``tokens`` at ``positions`` into ``slots`` under
        ``mask`` (1, 1, N, capacity): (N or 1, vocab) logits."""
        return static_forward(self.lean, tokens[None], positions[None], slots, mask, cache, self.columns.shape[0],
                              last_only=last_only)[0, :, :self.vocab]

    def _draw(self, probs: Tensor, depth: int) -> Tensor:
        """One token per row of (rows, vocab) ``probs``, from the uniforms of ``depth``."""
        return _draw(probs, self.config, self.uniforms[depth])

    def _run(self, cache) -> tuple[Tensor, Tensor]:
        chain, rows, block, columns = self.chain, self.rows, self.block, self.columns
        base = self.inputs[chain:]  # (1,)
        q = torch.empty(rows, block, self.vocab, dtype=torch.float32, device=columns.device)
        drafted = torch.empty(rows, block, dtype=torch.long, device=columns.device)
        # The unseen chain, causal after the prefix; its last position's law gives every path's first token.
        slots = base - chain + self.chain_offsets
        mask = (columns[None, :] <= slots[:, None])[None, None]
        logits = self._forward(self.inputs[:chain], slots, slots, mask, cache, last_only=True)
        first = process_logits(logits, self.config)  # (1, vocab)
        q[:, 0] = first
        tokens = drafted[:, 0] = self._draw(first.expand(rows, -1), 0)
        # Each depth: one forward over the path tips, each on its own path after the prefix.
        relative = columns - base  # (capacity,): a slot's place among the drafted nodes (< 0: the prefix)
        own = relative % rows == self.path_of[:, None]  # (rows, capacity)
        for i in range(1, block):
            slots = base + (i - 1) * rows + self.path_of
            mask = ((relative < 0) | (own & (relative < i * rows)))[None, None]
            probs = process_logits(self._forward(tokens, (base - 1 + i).expand(rows), slots, mask, cache,
                                                 last_only=False), self.config)
            q[:, i] = probs
            tokens = drafted[:, i] = self._draw(probs, i)
        return q, drafted


def _draw(probs: Tensor, config: SamplingConfig, uniforms: Tensor) -> Tensor:
    """One token per row of (R, vocab) ``probs`` by ``sample``'s rule, from ``uniforms`` ((R or 1, 1): a
    copy is drawn on, since the draw overwrites it and a replay must find the buffer as copied in)."""
    if config.greedy:
        return probs.argmax(-1)
    return draw_rows_at(probs, uniforms.clone())


def sampled_step(lean, cache, n: int, masked: bool, start: int, vocab: int, config: SamplingConfig,
                 draw: bool) -> "SampledStep | None":
    """The sampled step of this shape over row 0 of ``cache`` (made on first use), or None where the
    call runs otherwise (no static steps for ``lean``, too many queries, the cache's steps full)."""
    steps = iteration_steps(lean)
    if steps is None or n > MAX_QUERIES:
        return None
    return steps.kept(cache, ("sampled", n, masked, vocab, config, draw), start + n,
                      lambda: SampledStep(cache, n, masked, vocab, config, draw, steps))


class SampledStep(StaticStep):
    """A static step of one sequence's ``n`` queries that also computes ``process_logits`` of their
    first ``vocab`` logits under ``config``: the target's pass over a block or a tree, (n, vocab)
    float32; or, with ``draw``, only the last query's and one token drawn from it by ``sample``'s rule
    (a plain target step), a (1,) long tensor. Why: on a GPU the softmax and the draw after a replayed
    step were about ten more launches from Python, against one replay for the whole forward.

    A chain (not ``masked``) takes its ids and first slot in one copy (:meth:`chain`); its positions
    and slots are made inside. A tree takes the static step's buffers (a call, as a ``StaticStep``)."""

    def __init__(self, cache, n: int, masked: bool, vocab: int, config: SamplingConfig, draw: bool,
                 owner: StaticSteps) -> None:
        super().__init__(cache, 1, 0, n, masked, draw, owner)
        self.vocab, self.config, self.draw = vocab, config, draw
        with torch.inference_mode(False):
            self.uniforms = torch.zeros(1, 1, dtype=torch.float64, device=self.lean.device)
            self.packed = torch.zeros(n + 1, dtype=torch.long, device=self.lean.device)  # a chain's start, its ids
            self.offsets = torch.arange(n, device=self.lean.device)

    def _run(self, cache) -> Tensor:
        if self.mask is None:
            slots = self.packed[0] + self.offsets
            logits = self._forward(self.packed[None, 1:], slots[None], slots, None, cache)
        else:
            logits = super()._run(cache)
        probs = process_logits(logits[0, :, :self.vocab], self.config)
        return _draw(probs, self.config, self.uniforms) if self.draw else probs

    def chain(self, ids: list[int], start: int, cache, rng: TorchRandom | None = None) -> Tensor:
        """The chain ``ids`` at slots (= positions) ``start ..``; ``rng``: the source of a drawing step's
        uniform (:func:`fill_token_uniform`; None when greedy or without ``draw``). Returns a new
        tensor (above)."""
        packed = torch.tensor([start, *ids], dtype=torch.long)  # (one copy to the device for all)
        with self.owner.lock:
            self.packed.copy_(packed)
            if rng is not None:
                fill_token_uniform(self.uniforms, rng)
            return self._replay(cache)

    def chain_after(self, first: int, rest: Tensor, start: int, cache) -> Tensor:
        """:meth:`chain` of ``[first, *rest]`` where ``rest`` ((n - 1,) long) is still on the device (one
        path's drafts), copied in on the device: nothing is read back before the pass. Why: reading the
        drafts first (``.tolist()``) left the GPU idle from the end of the drafting until the host had
        built and copied in the chain and launched this pass."""
        head = torch.tensor([start, first], dtype=torch.long)
        with self.owner.lock:
            self.packed[:2].copy_(head)
            self.packed[2:].copy_(rest)
            return self._replay(cache)


# Plain target steps (``ar``, and ``auto``'s stretches of it) run this many at a time as one static call
# (:class:`PlainLoop`), each step's drawn token fed to the next on the device. Why: in the third H200
# run an ``ar`` step took 0.49-0.55 ms against 0.35 ms of kernels (the device busy 49% of the time):
# each step copied its input in, launched its replay and read its token back, and the GPU idled while
# the host did. A run of 8 pays that once, and the row loop's stop rules see 8 tokens at a time: at an
# EOS or a stop string the steps after it are thrown away (at most 7 forwards; rolling back is free).
# Runs are powers of two (8, 4, 2, 1: one recording each). On the CPU's host forward a run is one compiled
# call of any length up to 8 (``LeanCausalLM.sampled_run``): each call's Python and argument checks cost
# ~25 us, about 4% of a bfloat16 step of the bundled target, and the call ends at an EOS itself, since a
# thrown-away step costs a whole target step there. ``GBV_PLAIN_RUN`` sets the longest (1: a call per
# step, the form before, for before/after measurements).
def _plain_run() -> int:
    setting = os.environ.get("GBV_PLAIN_RUN", "8")
    if not setting.isdigit() or int(setting) < 1 or int(setting) & (int(setting) - 1):
        raise GbvError(f"GBV_PLAIN_RUN must be a power of two of at least 1 (plain steps run as one call), "
                       f"not {setting!r}; unset it for the default, 8")
    return int(setting)


PLAIN_RUN = _plain_run()


def stop_token_array(ids: Collection[int]) -> np.ndarray | None:
    """A generation's EOS ids as the sorted (k,) int64 array where a run of plain steps on the host ends
    (``LeanCausalLM.sampled_run``'s ``stop``); None where there are none."""
    return np.array(sorted(set(ids)), dtype=np.int64) if ids else None


def plain_run_length(lean, limit: int | None) -> int:
    """How many plain steps of ``lean`` to run as one call when at most ``limit`` may run (None: any
    number): the largest power of two up to ``min(PLAIN_RUN, limit)`` where static steps run, that
    number itself on the host forward (no recording per length), else 1."""
    longest = max(PLAIN_RUN if limit is None else min(PLAIN_RUN, limit), 1)
    if lean.host_forward is not None:
        return longest
    if iteration_steps(lean) is None:
        return 1
    return 1 << (longest.bit_length() - 1)


def plain_loop(lean, cache, count: int, start: int, vocab: int, config: SamplingConfig) -> "PlainLoop | None":
    """The loop of ``count`` plain steps over row 0 of ``cache`` (made on first use), or None where the
    steps run one at a time (no static steps for ``lean``, the cache's steps full)."""
    steps = iteration_steps(lean)
    if steps is None:
        return None
    return steps.kept(cache, ("plain", count, vocab, config), start + count,
                      lambda: PlainLoop(cache, count, vocab, config, steps))


class PlainLoop(Recorded):
    """``count`` plain target steps of one sequence as one call: step i feeds the token step i - 1 drew
    (the first: the pending token, at slot ``start``), writes its keys and values at slot ``start + i``,
    and draws the next token from the law ``process_logits`` gives its logits under ``config``, by
    ``sample``'s rule, from the i-th uniform. So it commits what ``count`` sampled steps
    (:class:`SampledStep` with ``draw``) commit from the same uniforms, taken from the random source in
    the same order (:meth:`__call__`)."""

    def __init__(self, cache, count: int, vocab: int, config: SamplingConfig, owner: StaticSteps) -> None:
        super().__init__(owner)
        lean = self.lean
        self.count, self.vocab, self.config = count, vocab, config
        capacity = cache.capacity
        lean.ensure_rotary(capacity)
        self.tables = lean._kind_tables  # (kept alive: the graph reads them; a regrowth makes a new dict)
        device = lean.device
        with torch.inference_mode(False):
            self.packed = torch.zeros(2, dtype=torch.long, device=device)  # the first slot, the pending token
            self.uniforms = torch.zeros(count, 1, 1, dtype=torch.float64, device=device)
            self.columns = torch.arange(capacity, device=device)

    def __call__(self, first: int, start: int, rng: TorchRandom | None, cache) -> Tensor:
        """Run from the pending token ``first`` at slot ``start``; ``rng``: the source of the draws (None
        when greedy). Returns a new (count,) long tensor of the drawn tokens."""
        packed = torch.tensor([start, first], dtype=torch.long)  # (one copy to the device for both)
        with self.owner.lock:
            self.packed.copy_(packed)
            if rng is not None:
                if rng.generator.device.type == "cpu":
                    self.uniforms.copy_(torch.from_numpy(rng.uniforms(self.count)).view(self.count, 1, 1))
                else:
                    # One fill per step, as each sampled step's (fill_token_uniform): the same uniforms
                    # from the same places in the stream, so a seed gives the tokens of the step-by-step
                    # form (one fill of all would draw others, by the same law).
                    for uniform in self.uniforms:
                        fill_token_uniform(uniform, rng)
            return self._replay(cache)

    def _run(self, cache) -> Tensor:
        columns, capacity = self.columns, self.columns.shape[0]
        token = self.packed[1:]  # (1,)
        drawn = []
        for i in range(self.count):
            slot = self.packed[:1] + i  # (1,)
            mask = (columns[None, :] <= slot[:, None])[None, None]
            logits = static_forward(self.lean, token[None], slot[None], slot, mask, cache, capacity,
                                    last_only=True)[0, :, :self.vocab]
            token = _draw(process_logits(logits, self.config), self.config, self.uniforms[i])
            drawn.append(token)
        return torch.cat(drawn)
