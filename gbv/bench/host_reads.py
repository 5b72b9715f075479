"""Counting host reads: the device -> host synchronisations a GPU pipeline would stall on.

On CPU nothing waits, but every ``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``float(t)``,
``t.__index__()`` and ``.numpy()`` of a tensor is such a place, and so are the implicit ones: indexing
with a 0-dim integer tensor (``x[t]``: torch reads ``t`` to the host and slices, pytorch/pytorch#105641)
or with a boolean mask, and ``nonzero`` (both need the count of hits on the host).
:func:`count_host_reads` counts them by wrapping those tensor methods for the duration of a
``with`` block. Used by tests/engine/test_syncs.py
(the budget of issue 8) and scripts/host_reads.py (the per-verifier table in docs/ENGINE.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero")
INDEXING = ("__getitem__", "__setitem__")


def _index_reads(index) -> bool:
    """Whether an index reads the host on a GPU: a 0-dim integer tensor or a boolean tensor in it."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, Tensor) and (part.dtype == torch.bool or
                                             (part.dim() == 0 and not part.is_floating_point()))
               for part in parts)


@contextlib.contextmanager
def count_host_reads() -> Iterator[dict[str, int]]:
    """``with count_host_reads() as reads: ...`` -- ``reads["n"]`` is the number of host reads inside."""
    counter = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in READS + INDEXING}
    original_nonzero = torch.nonzero

    def wrap(original):
        def counted(self, *args, **kwargs):
            counter["n"] += 1
            return original(self, *args, **kwargs)
        return counted

    def wrap_indexing(original):
        def counted(self, index, *args):
            if _index_reads(index):
                counter["n"] += 1
            return original(self, index, *args)
        return counted

    def nonzero(*args, **kwargs):
        counter["n"] += 1
        return original_nonzero(*args, **kwargs)

    for name in READS:
        setattr(torch.Tensor, name, wrap(originals[name]))
    for name in INDEXING:
        setattr(torch.Tensor, name, wrap_indexing(originals[name]))
    torch.nonzero = nonzero
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = original_nonzero


def verify_inputs(num_paths: int = 1, block_len: int = 8, vocab: int = 1000, seed: int = 0
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Random verifier inputs: (K, L) tokens drawn from softmax rows q (K, L, V), and independent
    softmax rows p (K, L+1, V), as tests/engine/test_syncs.py and scripts/host_reads.py count on."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(num_paths, block_len, vocab, generator=gen), -1)
    p = torch.softmax(torch.randn(num_paths, block_len + 1, vocab, generator=gen), -1)
    tokens = torch.stack([torch.multinomial(q[k], 1, generator=gen).squeeze(-1) for k in range(num_paths)])
    return tokens, q, p
