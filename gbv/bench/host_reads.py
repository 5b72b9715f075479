"""Counting host reads: the device -> host synchronisations a GPU pipeline would stall on.

On CPU nothing waits, but every ``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``float(t)``,
``t.__index__()`` and ``.numpy()`` of a tensor is such a place; :func:`count_host_reads` counts them by
wrapping those tensor methods for the duration of a ``with`` block. Used by tests/engine/test_syncs.py
(the budget of issue 8) and scripts/host_reads.py (the per-verifier table in docs/ENGINE.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")


@contextlib.contextmanager
def count_host_reads() -> Iterator[dict[str, int]]:
    """``with count_host_reads() as reads: ...`` -- ``reads["n"]`` is the number of host reads inside."""
    counter = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(original):
        def counted(self, *args, **kwargs):
            counter["n"] += 1
            return original(self, *args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(original))
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
