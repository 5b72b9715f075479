"""Lean forwards of a fixed shape over a fixed cache, replayed as CUDA graphs.

Why: on a GPU the engine's small models are launch-bound. In the first H200 run a 1-token step of the
bundled target cost 2.09 ms, 5.07x its matrix multiplies, at 12-13 GB/s of 3,665: about 150 kernels,
each launched from Python. A CUDA graph records one forward's kernels once; a replay launches them
all in one call. Measured on the H200 (docs/ENGINE.md, "CUDA graphs: static steps"): that step went
from 1.56 ms eager to 0.36 ms replayed (with ``lean._few_query_attention`` and ``torch.rms_norm``),
and ``ar`` from about 400 to about 1,960 tokens/s in float32.

A graph fixes the shape and the address of every tensor it touches. So a :class:`StaticStep`:

- reads its inputs from buffers of its own (tokens, positions, the slots it writes, the tree mask),
  copied in before each replay (device-to-device copies: nothing is read back);
- writes keys and values with ``index_copy_`` at slots held on the device, and attends every slot of
  the cache under a mask (slots after a query's own, or off its tree path, masked out), so that one
  graph serves every ``start``. A masked slot weighs exactly 0, so the result is the eager forward's
  up to summation order;
- is keyed by (rows, first row, queries, masked, last only) and kept on its cache (``KVCache.steps``),
  which drops them when it grows (new tensors).

Caches are pooled per model (:meth:`StaticSteps.cache`, capacities rounded up to a power of two) and
lent to one decoder at a time, so that the graphs of one generation serve the next; a step's output is
copied out of the graph's memory (the graphs of a model share one memory pool).

``GBV_CUDA_GRAPHS=0`` turns this off (the eager forward, for before/after measurements);
``GBV_CUDA_GRAPHS=static`` runs the same buffers and code without capturing, on any device (how the
CPU tests check everything here but the capture itself).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

import torch
from torch import Tensor

from gbv.errors import GbvError

logger = logging.getLogger("gbv")

# Calls with more queries than this (a prompt's chain) run eagerly: a graph per prompt length would
# be captured once and never replayed. Shorter chains run in pieces of a power of two queries
# (LeanCausalLM.chain), so that a few shapes serve every length.
MAX_QUERIES = 64
# A call is recorded at this use of its shape; the uses before run eagerly. At the first use: recording
# runs the call for real (its warm-up), so a shape used again loses nothing by being recorded at once,
# and each eager use before its recording is spent on top. In the third H200 run (float32) a target
# graph took 7.5 ms to record, warm-up included, a target step 1.9 ms eagerly and a 5-token pass 2.7
# (bench_cuda_graphs.py). Recorded at the fourth use, the shapes that ``auto``'s exploration meets (a
# few trials of each of its 12 arms; each drafting chain length, trie size and moved length) spent 1.6 s
# in eager uses against 0.7 s of recording over that run's benchmark, and ``auto`` made 0.61-0.64x
# ``ar``'s tokens/s (0.79x / 1.03x recorded at the second use, 0.79x at T = 1 at the first, 38 ms of it
# recording). ``GBV_RECORD_AT`` sets it (the suite records at the second use, so that both paths run:
# tests/conftest.py). docs/ENGINE.md, "The third GPU run".
def _record_at() -> int:
    setting = os.environ.get("GBV_RECORD_AT", "1")
    if not setting.isdigit() or int(setting) < 1:
        raise GbvError(f"GBV_RECORD_AT must be a whole number of at least 1 (the use of a shape at which it "
                       f"is recorded), not {setting!r}; unset it for the default, 1")
    return int(setting)


RECORD_AT = _record_at()
# Steps kept per cache (one per shape seen); past this many, new shapes run eagerly.
MAX_STEPS_PER_CACHE = 128
# Caches pooled per model; past this many at once, new ones are plain (their graphs die with them).
MAX_POOLED = 4
# Pooled capacities are powers of two of at least this many slots.
MIN_CAPACITY = 1024
# An iteration's work around the forwards recorded too: the drafting as one call, the target's law and
# draw with its step, the commit's cache moves (gbv/engine/static_sampling.py, StaticMove).
# ``GBV_STATIC_ITERATION=0`` turns that off: static steps then run one forward at a time, everything
# else launched call by call between them, for before/after measurements (scripts/bench_cuda_graphs.py,
# scripts/launch_counts.py).
RECORD_ITERATION = os.environ.get("GBV_STATIC_ITERATION", "1") != "0"
# Attention as three kernels over an additive mask made once per forward (lean._few_query_attention),
# not SDPA; a switch for measuring (scripts/bench_cuda_graphs.py).
FEW_QUERY_ATTENTION = True


def steps_mode(device: torch.device) -> str | None:
    """``"graph"`` on CUDA (the default), ``"static"`` under ``GBV_CUDA_GRAPHS=static`` (no capture,
    any device), None elsewhere or under ``GBV_CUDA_GRAPHS=0``."""
    setting = os.environ.get("GBV_CUDA_GRAPHS", "1")
    if setting == "static":
        return "static"
    if setting != "0" and device.type == "cuda":
        return "graph"
    return None


def recording_seconds(models) -> float:
    """Seconds the static steps of ``models`` (lean views; any other object counts 0) have spent so far
    recording CUDA graphs and running shapes before their recording (RECORD_AT): once-per-process work
    that ``auto`` does not charge to an arm."""
    return sum(steps.capture_seconds + steps.first_use_seconds
               for steps in (getattr(model, "steps", None) for model in models) if isinstance(steps, StaticSteps))


class StaticSteps:
    """The static steps and pooled caches of the lean model ``lean``; ``capture``: record CUDA graphs."""

    def __init__(self, lean, capture: bool) -> None:
        self.lean = lean
        self.capture = capture
        self.record_at = RECORD_AT  # (read when made: a test may change the module's setting)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._caches: list[list] = []  # [cache, weak reference to its borrower]
        self.captures = 0  # graphs recorded, and the seconds spent recording them (warm-up included)
        self.capture_seconds = 0.0
        # Seconds of the eager calls before a shape is recorded (RECORD_AT > 1), timed between device
        # syncs. Why: ``auto`` credits an arm with its iterations' seconds, and eager uses run at 2-6x
        # their replayed cost on the H200: one such trial could keep an arm under its ceiling for good
        # (auto.AutoPolicy.ceiling). Subtracted whole (the replay they stand for too), they flatter the
        # arm instead, until its shapes are recorded: in the third GPU run, at RECORD_AT = 4, `auto` ran
        # such arms often. Recorded at the first use (the default) there are none.
        self.first_use_seconds = 0.0
        self.stream = None  # the side stream that records (one: each stream gets its own cuBLAS workspace)
        # The first graph recorded, kept for good: a memory pool is freed with the last graph that uses
        # it, and recording into a freed pool's handle fails (an internal assert in torch's allocator,
        # met on an H200 once every graph had died with the caches of a benchmark's micro-measurements).
        self._anchor = None
        # One step at a time per model: the graphs share one memory pool, so a replay may overwrite the
        # output of another graph's replay before it is copied out (two threads generating at once).
        self.lock = threading.RLock()

    def cache(self, batch: int, capacity: int, owner) -> "KVCache":  # noqa: F821
        """A cache of ``batch`` rows and at least ``capacity`` slots lent to ``owner`` while it lives:
        the smallest free pooled one, else a new one (pooled while there is room)."""
        capacity = max(MIN_CAPACITY, 1 << (capacity - 1).bit_length())
        free = [entry for entry in self._caches
                if entry[0].keys[0].shape[0] == batch and entry[0].capacity >= capacity
                and entry[1]() is None]
        if free:
            entry = min(free, key=lambda e: e[0].capacity)
            entry[1] = weakref.ref(owner)
            cache = entry[0]
        else:
            with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
                cache = self.lean.plain_cache(batch, capacity)
            if len(self._caches) < MAX_POOLED:
                self._caches.append([cache, weakref.ref(owner)])
        # The rotary tables every static call of this cache reads, grown now: growing them inside the
        # first iteration (the prompt runs eagerly, over fewer positions) would read the host there.
        self.lean.ensure_rotary(cache.capacity)
        return cache

    def get(self, cache, batch: int, n: int, masked: bool, causal: bool, last_only: bool, first_row: int,
            start: int) -> "StaticStep | None":
        """The step for this call's shape (made on first use), or None where the call runs eagerly."""
        if n > MAX_QUERIES or (not masked and n > 1 and not causal):
            return None  # (the second: an error the eager forward reports)
        return self.kept(cache, (batch, first_row, n, masked, last_only), start + n,
                         lambda: StaticStep(cache, batch, first_row, n, masked, last_only, self))

    def kept(self, cache, key, end: int, make) -> "Recorded | None":
        """The static call kept on ``cache`` under ``key``, made by ``make()`` on first use, the cache
        grown first to hold slots up to ``end``; None where the cache holds MAX_STEPS_PER_CACHE calls."""
        if end > cache.capacity:
            cache.grow(end)  # (drops the cache's calls: its tensors are new)
        call = cache.steps.get(key)
        if call is None:
            if len(cache.steps) >= MAX_STEPS_PER_CACHE:
                return None
            call = cache.steps[key] = make()
        return call


def static_forward(lean, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, cache, capacity: int,
                   first_row: int = 0, last_only: bool = False) -> Tensor:
    """The lean forward as every static call records it: (B, N) ``tokens`` at ``positions`` ((B, N))
    written into ``slots`` ((N,), on the device) of cache rows ``first_row ..``, attending every one of
    the cache's ``capacity`` slots under ``mask`` ((B or 1, 1, N, capacity) bool), so that its shapes do
    not depend on where it writes. Returns (B, N or 1, V) logits."""
    batch, n = tokens.shape
    cos, sin, rotations = lean.rotations(positions, capacity)
    hidden = lean.embed_rows(tokens.reshape(-1), positions.reshape(-1))
    bias = lean.attention_bias(mask, batch) if FEW_QUERY_ATTENTION else None
    # The layers with a sliding window (Mistral v0.1, Phi-3 4k, Gemma 2 / 3) mask the slots before it too,
    # at every call: a recorded step's positions change from replay to replay.
    window_mask = window_bias = None
    if lean.window is not None:
        window_mask = lean.windowed(mask, positions)
        window_bias = lean.attention_bias(window_mask, batch) if FEW_QUERY_ATTENTION else None
    hidden = lean._layers(hidden, batch, n, cos, sin, cache, first_row, 0, slots, mask, False, bias,
                          window_mask=window_mask, rotations=rotations, window_bias=window_bias)
    return lean._head(hidden, batch, n, last_only)


class Recorded:
    """A call over buffers of its own, run as it is or, on CUDA, recorded once as a graph and replayed.
    Subclasses make the buffers, fill them before each call and define :meth:`_run` over them."""

    # Whether running :meth:`_run` twice on the same buffers leaves what running it once leaves. A
    # recording runs it once for real (the warm-up) before the replay of the same call: for a call
    # that is not repeatable, that replay is skipped (the warm-up's result is the call's).
    REPEATABLE = True

    def __init__(self, owner: StaticSteps) -> None:
        self.owner = owner
        self.lean = owner.lean
        self.graph = None
        self.output = None
        self.calls = 0

    def _run(self, cache):
        """The work over the buffers; a tensor or a tuple of tensors."""
        raise NotImplementedError

    def _replay(self, cache):
        """:meth:`_run`'s result for the buffers as they are now: run as it is, or from the recorded
        graph (a copy of its output: a later graph of this model may reuse the output's memory).
        Under the owner's lock."""
        self.calls += 1
        if not self.owner.capture:
            return self._run(cache)
        if self.graph is None and self.calls < self.owner.record_at:  # (see RECORD_AT)
            return self._first_use(cache)
        if self.graph is None:
            try:
                warm = self._capture(cache)
            except RuntimeError as error:  # (a torch or driver without what recording needs: run eagerly)
                logger.warning("gbv: recording a CUDA graph failed (%s); this model's forwards run without "
                               "graphs from now on (GBV_CUDA_GRAPHS=0 skips trying)", str(error).splitlines()[0])
                self.lean.steps = None
                return self._run(cache)
            if not self.REPEATABLE:
                return warm
        self.graph.replay()
        if isinstance(self.output, tuple):
            return tuple(out.clone() for out in self.output)
        return self.output.clone()

    def _first_use(self, cache):
        """:meth:`_run` before the shape is recorded, its time added to the owner's ``first_use_seconds``
        (after a device sync each side on CUDA: a few calls per shape and process)."""
        device = self.lean.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        result = self._run(cache)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.owner.first_use_seconds += time.perf_counter() - began
        return result

    def _capture(self, cache):
        """Record :meth:`_run` as a CUDA graph; returns the warm-up's result. A warm-up on a side stream
        first (lazy initialisation must not happen while capturing); it runs the real call, writing
        the same keys and values the replay writes again (see REPEATABLE). Without
        ``torch.cuda.graph``'s ``gc.collect()`` per capture (tens of ms)."""
        began = time.perf_counter()
        device = self.lean.device
        if self.owner.stream is None:
            self.owner.stream = torch.cuda.Stream(device)
        stream = self.owner.stream
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            warm = self._run(cache)
            torch.cuda.synchronize(device)  # (as torch.cuda.graph does: nothing in flight while recording)
            graph = torch.cuda.CUDAGraph()
            # thread_local: what other threads launch meanwhile does not break this recording
            graph.capture_begin(self.owner.pool, capture_error_mode="thread_local")
            try:
                self.output = self._run(cache)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = graph
        if self.owner._anchor is None:
            self.owner._anchor = graph
        self.owner.captures += 1
        self.owner.capture_seconds += time.perf_counter() - began
        return warm


class StaticStep(Recorded):
    """One forward shape over one cache: ``batch`` rows from ``first_row``, ``n`` queries, a tree mask
    or not (then each query attends every slot up to its own), all logits or the last query's."""

    def __init__(self, cache, batch: int, first_row: int, n: int, masked: bool, last_only: bool,
                 owner: StaticSteps) -> None:
        super().__init__(owner)
        lean = self.lean
        self.batch, self.first_row, self.n, self.last_only = batch, first_row, n, last_only
        capacity = cache.capacity
        lean.ensure_rotary(capacity)
        # The graph reads the rotary tables as they are now: keep them alive should they be regrown.
        self.tables = lean._kind_tables  # (every kind's (cos, sin, rot); a regrowth makes a new dict)
        device = lean.device
        with torch.inference_mode(False):
            self.tokens = torch.zeros(batch, n, dtype=torch.long, device=device)
            self.positions = torch.zeros(batch, n, dtype=torch.long, device=device)
            self.slots = torch.zeros(n, dtype=torch.long, device=device)
            self.columns = torch.arange(capacity, device=device)
            self.mask = torch.zeros(batch, 1, n, capacity, dtype=torch.bool, device=device) if masked else None

    def _run(self, cache) -> Tensor:
        """The forward over the buffers: (B, N or 1, V) logits."""
        return self._forward(self.tokens, self.positions, self.slots, self.mask, cache)

    def _forward(self, tokens: Tensor, positions: Tensor, slots: Tensor, mask: Tensor | None, cache) -> Tensor:
        """:func:`static_forward` of this step's rows; ``mask`` None: each query attends every slot up to
        its own."""
        if mask is None:  # (the prefix, and the chain causally)
            mask = (self.columns[None, :] <= slots[:, None])[None, None]
        return static_forward(self.lean, tokens, positions, slots, mask, cache, self.columns.shape[0],
                              self.first_row, self.last_only)

    def __call__(self, tokens: Tensor, positions: Tensor, start: int, mask: Tensor | None, cache) -> Tensor:
        """``LeanCausalLM.forward`` of (B, N) ``tokens`` at ``positions`` written from slot ``start``
        under ``mask`` ((B or 1, 1, N, start + N) bool, or None); a new (B, N or 1, V) tensor."""
        with self.owner.lock:  # (the buffers, and the pool's memory between a replay and its copy out)
            n = self.n
            self.tokens.copy_(tokens)
            self.positions.copy_(positions)
            self.slots.copy_(self.columns[start:start + n])
            if self.mask is not None:
                width = start + n
                self.mask[..., :width].copy_(mask)
                self.mask[..., width:].zero_()
            return self._replay(cache)


class StaticMove(Recorded):
    """``KVCache.move`` of ``count`` slots of row 0 (a single sequence's cache), every layer's keys and
    values, as one recorded call: the commit of an accepted path whose nodes do not sit at their depth
    (an index and an ``index_put_`` per layer and per keys / values otherwise: 32 launches for the
    bundled target)."""

    REPEATABLE = False  # (a second move reads slots the first has overwritten where sources and targets overlap)

    def __init__(self, count: int, owner: StaticSteps) -> None:
        super().__init__(owner)
        with torch.inference_mode(False):
            self.indices = torch.zeros(2, count, dtype=torch.long, device=owner.lean.device)  # src, dst

    def __call__(self, src: list[int], dst: list[int], cache) -> None:
        indices = torch.tensor([src, dst], dtype=torch.long)  # (one copy to the device for both)
        with self.owner.lock:
            self.indices.copy_(indices)
            self._replay(cache)

    def _run(self, cache) -> tuple:
        src, dst = self.indices
        for store in (cache.keys, cache.values):
            for tensor in store:
                tensor[0, :, dst] = tensor[0, :, src]  # (the right side is a copy: read whole, then written)
        return ()


def iteration_steps(lean) -> StaticSteps | None:
    """``lean``'s static steps where an iteration's work around the forwards is recorded too
    (:data:`RECORD_ITERATION`: the drafting, the sampled steps, ar's runs, the commit's moves), else None."""
    steps = lean.steps
    return steps if RECORD_ITERATION and isinstance(steps, StaticSteps) else None


def move(lean, cache, src: list[int], dst: list[int]) -> None:
    """``cache.move(src, dst)`` (row 0), as a :class:`StaticMove` where ``lean`` has static steps: of a
    power of two moves, the last one repeated (it writes the same values again), so that a few recorded
    moves serve every accepted length."""
    steps = iteration_steps(lean)
    call = None
    if steps is not None and cache.keys[0].shape[0] == 1:
        count = 1 << (len(src) - 1).bit_length()
        src, dst = src + src[-1:] * (count - len(src)), dst + dst[-1:] * (count - len(dst))
        call = steps.kept(cache, ("move", count), 0, lambda: StaticMove(count, steps))
    if call is None:
        cache.move(src, dst)
    else:
        call(src, dst, cache)
