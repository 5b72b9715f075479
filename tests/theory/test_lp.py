"""The information-agnostic LP (SPEC section 7, gbv/theory/lp.py).

Sizes (estimate of ``lp_size``, ``symmetric=True``) and HiGHS CPU times measured on a shared 2-core
machine: V=2 L=2 K=3 -> 198 variables, < 0.01 s; V=3 L=3 K=3 mixed -> 82k variables, 0.6 s;
V=2 L=7 K=2 dirichlet -> 248k variables / 498k nonzeros, ~32 s (the largest the guard admits);
V=11 L=2 K=2 dirichlet -> 407k / 817k, ~77 s (refused by the guard).
"""

from __future__ import annotations

import pytest
from scipy.optimize import OptimizeResult

import gbv.theory.lp as lp_module
from gbv.theory import InstanceError, context_free_instance, exact_analysis, random_instance
from gbv.theory.lp import LPError, build_lp, check_lp_size, lp_optimum, lp_size
from gbv.verify import METHODS, get_verifier, is_multi_path

SPEC_LP = {1: 11 / 9, 2: 131 / 81, 3: 1351 / 729}


def spec_instance(num_paths: int):
    return context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], block_len=2, num_paths=num_paths)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("num_paths", [1, 2, 3])
def test_spec_reference_values(num_paths, symmetric):
    assert lp_optimum(spec_instance(num_paths), symmetric=symmetric) == pytest.approx(SPEC_LP[num_paths], abs=1e-9)


K1_CASES = [(vocab, length, kind) for vocab, length in [(2, 1), (2, 2), (3, 2), (4, 2), (2, 3), (3, 3)]
            for kind in ["mixed", "sharp", "truncated", "dirichlet", "equal"]]


@pytest.mark.parametrize("vocab,length,kind", K1_CASES)
def test_single_path_optimum_is_block_verification(vocab, length, kind):
    """K = 1: BV is optimal among all lossless verifiers, even with off-path information."""
    block = get_verifier("block")
    for seed in range(3):
        inst = random_instance(vocab, length, 1, seed=seed, kind=kind)
        expected = exact_analysis(block, inst).expected_accepted
        assert lp_optimum(inst) == pytest.approx(expected, abs=1e-7), f"seed {seed}"
        if kind == "equal":  # p = q: everything is accepted
            assert lp_optimum(inst) == pytest.approx(length, abs=1e-7)


MULTI_CASES = [(2, 1, 2), (3, 1, 2), (2, 2, 2), (2, 1, 3),
               pytest.param(3, 2, 2, marks=pytest.mark.slow), pytest.param(2, 2, 3, marks=pytest.mark.slow),
               pytest.param(4, 1, 3, marks=pytest.mark.slow), pytest.param(2, 3, 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("vocab,length,num_paths", MULTI_CASES)
@pytest.mark.parametrize("kind", ["mixed", "sharp", "truncated"])
def test_optimum_bounds_every_method(vocab, length, num_paths, kind):
    """K > 1: no lossless verifier beats the LP; more paths never lower the optimum."""
    for seed in range(2):
        inst = random_instance(vocab, length, num_paths, seed=seed, kind=kind)
        optimum = lp_optimum(inst)
        for name in METHODS:
            paths = num_paths if is_multi_path(name) else 1
            accepted = exact_analysis(get_verifier(name), inst, num_paths=paths).expected_accepted
            assert accepted <= optimum + 1e-7, f"{name} beats the LP on seed {seed}: {accepted} > {optimum}"
        assert optimum >= lp_optimum(inst, num_paths=num_paths - 1) - 1e-7
        assert optimum <= length + 1e-7


@pytest.mark.parametrize("vocab,length,num_paths", [(2, 2, 2), (3, 1, 3), (2, 1, 4)])
def test_symmetric_reduction_matches_ordered_tuples(vocab, length, num_paths):
    for seed in range(2):
        inst = random_instance(vocab, length, num_paths, seed=seed, kind="mixed")
        ordered, unordered = build_lp(inst, symmetric=False), build_lp(inst, symmetric=True)
        assert unordered.size.variables <= ordered.size.variables
        assert lp_optimum(inst, symmetric=True) == pytest.approx(lp_optimum(inst, symmetric=False), abs=1e-8)


def test_size_estimate_bounds_the_built_problem():
    for vocab, length, num_paths in [(2, 2, 3), (3, 2, 2), (4, 1, 3)]:
        inst = random_instance(vocab, length, num_paths, seed=0, kind="dirichlet")
        for symmetric in (True, False):
            built, estimate = build_lp(inst, symmetric=symmetric).size, lp_size(inst, symmetric=symmetric)
            assert built.tuples == estimate.tuples  # dirichlet rows have no zeros
            assert built.variables <= estimate.variables and built.nonzeros <= estimate.nonzeros


def test_too_large_is_a_one_line_instance_error():
    inst = random_instance(4, 3, 3, seed=0, kind="dirichlet")  # 4^9 draft tuples: never built
    with pytest.raises(InstanceError) as info:
        check_lp_size(inst)
    assert "too large for the LP" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(InstanceError):
        lp_optimum(inst)


def test_guard_limits_are_read_at_call_time(monkeypatch):
    monkeypatch.setattr(lp_module, "MAX_LP_NONZEROS", 100)
    with pytest.raises(InstanceError):
        lp_optimum(spec_instance(3))


def test_solver_failure_is_a_one_line_lp_error(monkeypatch):
    def failing_linprog(*args, **kwargs):
        return OptimizeResult(status=4, x=None, fun=None, message="The HiGHS status code was not recognized.\n"
                                                                  "(HiGHS Status 15: model_status is Unknown)")

    monkeypatch.setattr(lp_module, "linprog", failing_linprog)
    with pytest.raises(LPError) as info:
        lp_optimum(spec_instance(2))
    assert "HiGHS" in str(info.value) and "\n" not in str(info.value)
