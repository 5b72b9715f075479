"""Verifiers: pure functions ``(draft_tokens, q, p, rng) -> VerifyResult``. One file per method.

=============  ==========================================  =====================
name           method                                      file
=============  ==========================================  =====================
``token``      token-level speculative sampling (K = 1)    ``gbv/verify/token.py``
``block``      Block Verification, BV (K = 1)              ``gbv/verify/block.py``
``gbv``        Greedy Multi-Path Block Verification        ``gbv/verify/gbv.py``
``gbv-adaptive`` GBV with adaptive greedy selection (SPEC 11) ``gbv/verify/gbv_adaptive.py``
``specinfer``  recursive rejection sampling, multi-path    ``gbv/verify/specinfer.py``
``spectr``     SpecTr K-SEQ, multi-path                    ``gbv/verify/spectr.py``
``traversal``  Traversal Verification, multi-path          ``gbv/verify/traversal.py``
=============  ==========================================  =====================

Shapes and the random-source contract are in :mod:`gbv.verify.common`; the mathematics is in
``docs/SPEC.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gbv._lazy import lazy_names

if TYPE_CHECKING:
    from gbv.verify.common import RandomSource, TorchRandom, Verifier, VerifyResult

# The registry's names without torch: ``gbv generate --help`` lists them, and importing torch took it from 0.2 to 2 s.
# The shared types are :mod:`gbv.verify.common`'s, imported when first asked for.
__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(("RandomSource", "TorchRandom", "Verifier", "VerifyResult"),
                                                          "gbv.verify.common"))

# name -> (module, function, uses all K paths). Imported lazily so that one method's module
# loading never slows down or breaks another's.
_REGISTRY: dict[str, tuple[str, str, bool]] = {
    "token": ("gbv.verify.token", "verify_token", False),
    "block": ("gbv.verify.block", "verify_block", False),
    "gbv": ("gbv.verify.gbv", "verify_gbv", True),
    "gbv-adaptive": ("gbv.verify.gbv_adaptive", "verify_gbv_adaptive", True),
    "specinfer": ("gbv.verify.specinfer", "verify_specinfer", True),
    "spectr": ("gbv.verify.spectr", "verify_spectr", True),
    "traversal": ("gbv.verify.traversal", "verify_traversal", True),
}

METHODS: tuple[str, ...] = tuple(_REGISTRY)
MULTI_PATH_METHODS: tuple[str, ...] = tuple(name for name, entry in _REGISTRY.items() if entry[2])


def get_verifier(name: str) -> Verifier:
    """The verifier function called ``name`` (one of :data:`METHODS`)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown verifier {name!r}; choose one of: {', '.join(METHODS)}")
    module, function, _ = _REGISTRY[name]
    return getattr(importlib.import_module(module), function)


def is_multi_path(name: str) -> bool:
    """Whether the method looks at all K drafted paths (``token`` and ``block`` use path 0 only)."""
    get_verifier(name)
    return _REGISTRY[name][2]


__all__ = ["METHODS", "MULTI_PATH_METHODS", "RandomSource", "TorchRandom", "Verifier", "VerifyResult",
           "get_verifier", "is_multi_path"]
