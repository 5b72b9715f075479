"""How many CPU threads torch and the compiled products use, by default and on request (``--threads``).

Measured on the 2-core machines (docs/ENGINE.md, "Threads" and "The compiled forward on several threads"):

- torch's ops on two threads collapse (120 -> 1.5 tokens/s) when another process holds one of the cores,
  because OpenMP's threads wait on each other at every op. So models of up to 100M parameters, whose steps
  are overhead- and memory-bound, keep torch on one thread.
- The compiled products split a large weight's columns among their own threads, and the calling thread
  never waits for a share nobody took, so they do not collapse: a Pythia-70m-shaped pair's `ar` ran at
  1.9x on two threads when idle, and at 0.94x one thread's with another process spinning. So targets of
  ``SPLIT_MODEL_PARAMETERS`` to 100M parameters run their products on every core while torch keeps one
  thread; smaller ones (the bundled pair) stay on one thread throughout, since their products are too
  small to split with profit.
- Larger models keep torch's default (one thread per core), whose matrix products do scale with threads,
  and their compiled products follow it; where the target runs on the compiled host forward, torch keeps one
  thread and the products every core, as for 30-100M (:func:`apply_threads`).

``--threads N`` sets both to N.
"""

from __future__ import annotations

import contextlib

import torch

from gbv.engine import host_kernels

SMALL_MODEL_PARAMETERS = 100_000_000
SPLIT_MODEL_PARAMETERS = 30_000_000


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters()) if model is not None else 0


def _on_cpu(target) -> bool:
    return all(p.device.type == "cpu" for p in target.parameters())


# torch's intra-op threads as gbv found them (this module's import, before apply_threads changes them): one
# per physical core by default, OMP_NUM_THREADS where set. "Every core" for the products (:func:`every_core`),
# for both defaults that give them every core. (Before, a 30-100M target's counted the CPUs of the affinity
# mask, hyperthreads included and OMP_NUM_THREADS ignored, and a larger one's read torch's count at the
# call, which a first apply_threads had set to one.)
_TORCH_THREADS_FOUND = torch.get_num_threads()


# ``--threads N``'s N where apply_threads was given one (building_threads keeps to it), else None.
_requested: int | None = None


def every_core() -> int:
    """The compiled products' threads where they take every core: torch's intra-op count as gbv found it
    (at most 64, the products' limit)."""
    return min(_TORCH_THREADS_FOUND, 64)


def default_threads(target) -> int | None:
    """torch's threads by default: 1 for a small target on CPU, else None (leave torch's default)."""
    return 1 if _on_cpu(target) and parameter_count(target) <= SMALL_MODEL_PARAMETERS else None


def default_product_threads(target) -> int | None:
    """The compiled products' threads by default: every core for a CPU target of ``SPLIT_MODEL_PARAMETERS`` to
    ``SMALL_MODEL_PARAMETERS`` parameters (torch itself on one thread), else None (they follow torch's
    count: one thread for smaller targets, torch's default for larger ones)."""
    count = parameter_count(target)
    if _on_cpu(target) and SPLIT_MODEL_PARAMETERS <= count <= SMALL_MODEL_PARAMETERS:
        return every_core()
    return None


def _compiled_target(target, draft) -> bool:
    """Whether the pair decodes on the lean tree engine with the target on the compiled host forward (one
    compiled call a step, chosen by measurement when its lean view is built: built here, as the first
    generation would)."""
    from gbv.engine.decoder import engine_for
    from gbv.engine.tree_decoder import lean_model

    if engine_for(target, draft) != "tree":
        return False
    host = lean_model(target).host_forward
    return host is not None and host.one_call(1)


def apply_threads(threads: int | str | None, target, draft=None) -> int:
    """Set torch's intra-op threads and the compiled products': an int for both, or ``None``/``"auto"`` for
    :func:`default_threads` and :func:`default_product_threads`. Returns torch's number in force.

    By default a CPU target of over 100M parameters that runs on the compiled host forward (with ``draft``,
    on the lean tree engine) then keeps torch on one thread and its products on every core, as a 30-100M
    one does: its steps are the products', which do not collapse on a shared machine, while torch's ops
    in between do. A random SmolLM2-360M / 135M pair in bfloat16 ran BV L = 4 at 39.3 tokens/s that way
    against 35.7 with torch on both cores, and at 19.5 against 16.1 with another process spinning
    (docs/ENGINE.md, "The compiled forward on several threads"). The target's lean view is built to know
    (the first generation would build it)."""
    global _requested
    products = None
    _requested = None if threads is None or threads == "auto" else int(threads)
    if threads is None or threads == "auto":
        threads = default_threads(target)
        products = default_product_threads(target)
        if threads is None and _on_cpu(target) and _compiled_target(target, draft):
            threads, products = 1, every_core()
    if threads is not None:
        torch.set_num_threads(int(threads))
    host_kernels.set_product_threads(products)
    return torch.get_num_threads()


@contextlib.contextmanager
def building_threads(model):
    """Every core (:func:`every_core`; ``--threads N``'s N where given) for torch's ops while a lean view of ``model``
    (of at least ``SPLIT_MODEL_PARAMETERS``) copies its weights (their widened and transposed copies, the bf16
    rounding), then the count in force before. The copies hold the same values at any count (no sums: a fold's
    float64 product runs on one thread, ``lean._widened_product``); the forward choice that follows runs at the
    counts in force. Why: a first call builds each view once, and on one thread the copies were most of a
    Gemma-3-1B / 270M pair's 24 s to the first tokens (a 262k x 1,152 embedding's transposed copy 1.06 s on one
    thread, 0.55 s on two; ``scripts/bench_first_call.py --profile``); ``apply_threads`` keeps torch on one thread
    for a compiled target, so the draft's view was built on one. Smaller models' copies take milliseconds:
    unchanged. The packing of the panels keeps the products' count: on two threads it was slower here (its fresh
    memory's pages, faulted in by both threads at once), 16.0 and 14.0 s against 14.2 and 11.5 s for the target's
    view in alternating runs."""
    if parameter_count(model) < SPLIT_MODEL_PARAMETERS or not _on_cpu(model):
        yield
        return
    cores = every_core() if _requested is None else _requested
    with _torch_threads(max(torch.get_num_threads(), cores)):
        yield


def one_torch_thread():
    """torch on one thread for a computation whose bits must not hang on the thread count (a reduction that
    several threads would split), then the count before (a context manager)."""
    return _torch_threads(1)


@contextlib.contextmanager
def _torch_threads(count: int):
    """torch's intra-op threads at ``count`` inside, the count before after (set only where they differ)."""
    before = torch.get_num_threads()
    try:
        if count != before:
            torch.set_num_threads(count)
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
