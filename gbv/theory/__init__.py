"""Exact theory on tiny instances: the law of any verifier by enumeration, and the LP bound.

The names below are imported from their modules when first asked for: the enumeration imports torch (~2 s), which
``gbv bound --help`` and the instance checks do not need."""

from __future__ import annotations

from gbv._lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {
    **dict.fromkeys(("ExactAnalysis", "ReplayRandom", "enumerate_branches", "exact_analysis"), "gbv.theory.enumerate"),
    **dict.fromkeys(("InstanceError", "TinyInstance", "context_free_instance", "load_instance", "parse_instance",
                     "random_instance"), "gbv.theory.instance"),
})

__all__ = ["ExactAnalysis", "InstanceError", "ReplayRandom", "TinyInstance", "context_free_instance",
           "enumerate_branches", "exact_analysis", "load_instance", "parse_instance", "random_instance"]
