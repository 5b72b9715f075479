"""Exact theory on tiny instances: the law of any verifier by enumeration, and the LP bound."""

from gbv.theory.enumerate import ExactAnalysis, ReplayRandom, enumerate_branches, exact_analysis
from gbv.theory.instance import (InstanceError, TinyInstance, context_free_instance, load_instance,
                                 parse_instance, random_instance)

__all__ = ["ExactAnalysis", "InstanceError", "ReplayRandom", "TinyInstance", "context_free_instance",
           "enumerate_branches", "exact_analysis", "load_instance", "parse_instance", "random_instance"]
