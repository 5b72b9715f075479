"""Exact theory on tiny instances: the law of any verifier by enumeration, and the LP bound.

The names below are imported from their modules when first asked for: the enumeration imports torch (~2 s), which
``gbv bound --help`` and the instance checks do not need."""

from __future__ import annotations

import importlib

_NAMES = {
    **dict.fromkeys(("ExactAnalysis", "ReplayRandom", "enumerate_branches", "exact_analysis"), "gbv.theory.enumerate"),
    **dict.fromkeys(("InstanceError", "TinyInstance", "context_free_instance", "load_instance", "parse_instance",
                     "random_instance"), "gbv.theory.instance"),
}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'gbv.theory' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's own names and the ones imported when first asked for (``dir()``, tab completion)."""
    return sorted(set(globals()) | set(__all__))


__all__ = ["ExactAnalysis", "InstanceError", "ReplayRandom", "TinyInstance", "context_free_instance",
           "enumerate_branches", "exact_analysis", "load_instance", "parse_instance", "random_instance"]
