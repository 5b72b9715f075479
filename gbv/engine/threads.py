"""How many CPU threads torch uses, by default and on request (``--threads``).

Measured on the 2-core machines (docs/ENGINE.md, ../NOTES): for models of up to ~100M parameters a
decode step is overhead- and memory-bound, one thread is as fast as two when the machine is idle, and
two threads collapse (120 -> 1.5 tokens/s) when another process holds one of the cores, because
OpenMP's threads wait on each other at every op. So small models default to one thread; larger
models, whose matrix multiplies do scale with threads, keep torch's default (one per core).
"""

from __future__ import annotations

import torch

SMALL_MODEL_PARAMETERS = 100_000_000


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters()) if model is not None else 0


def default_threads(target) -> int | None:
    """1 for a small target on CPU, else None (leave torch's default)."""
    on_cpu = all(p.device.type == "cpu" for p in target.parameters())
    return 1 if on_cpu and parameter_count(target) <= SMALL_MODEL_PARAMETERS else None


def apply_threads(threads: int | str | None, target) -> int:
    """Set torch's intra-op threads: an int, or ``None``/``"auto"`` for :func:`default_threads`.
    Returns the number in force."""
    if threads is None or threads == "auto":
        threads = default_threads(target)
    if threads is not None:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()
