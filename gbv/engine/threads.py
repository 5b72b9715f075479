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
  and their compiled products follow it.

``--threads N`` sets both to N.
"""

from __future__ import annotations

import os

import torch

from gbv.engine import host_kernels

SMALL_MODEL_PARAMETERS = 100_000_000
SPLIT_MODEL_PARAMETERS = 30_000_000


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters()) if model is not None else 0


def _on_cpu(target) -> bool:
    return all(p.device.type == "cpu" for p in target.parameters())


def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def default_threads(target) -> int | None:
    """torch's threads by default: 1 for a small target on CPU, else None (leave torch's default)."""
    return 1 if _on_cpu(target) and parameter_count(target) <= SMALL_MODEL_PARAMETERS else None


def default_product_threads(target) -> int | None:
    """The compiled products' threads by default: every core for a CPU target of ``SPLIT_MODEL_PARAMETERS`` to
    ``SMALL_MODEL_PARAMETERS`` parameters (torch itself on one thread), else None (they follow torch's
    count: one thread for smaller targets, torch's default for larger ones)."""
    count = parameter_count(target)
    if _on_cpu(target) and SPLIT_MODEL_PARAMETERS <= count <= SMALL_MODEL_PARAMETERS:
        return min(cores(), 64)
    return None


def apply_threads(threads: int | str | None, target) -> int:
    """Set torch's intra-op threads and the compiled products': an int for both, or ``None``/``"auto"`` for
    :func:`default_threads` and :func:`default_product_threads`. Returns torch's number in force."""
    products = None
    if threads is None or threads == "auto":
        threads = default_threads(target)
        products = default_product_threads(target)
    if threads is not None:
        torch.set_num_threads(int(threads))
    host_kernels.set_product_threads(products)
    return torch.get_num_threads()
