"""Master losslessness test: every verifier in METHODS, exact enumeration, many random tiny instances.

The check (:func:`law_error`) runs the verifier on every K-tuple of drafted paths and every random
branch (gbv.theory.enumerate) and compares the completed law of the emitted tokens with the target
law on all of V^(L+1). The negative controls at the end show that this very check catches a broken
block verifier and a broken token-level sampler. Per-method negative controls live beside each
method's own tests (test_gbv.py, test_specinfer.py, ...).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gbv.theory import TinyInstance, enumerate_branches, exact_analysis, random_instance
from gbv.verify import METHODS, get_verifier, is_multi_path
from gbv.verify.common import VerifyResult, check_shapes, on_path_probs, residual

from exact_checks import FAST, KINDS, LOSSLESS_TOL, SLOW, check_greedy, grid_seed, one_hot_table, tuple_inputs


def law_error(verifier, inst: TinyInstance, num_paths: int) -> float:
    """Max |completed law - target law|; a verifier the enumerator rejects (negative or unnormalised
    sampling distribution, impossible decision) counts as infinitely wrong."""
    try:
        return exact_analysis(verifier, inst, num_paths=num_paths).max_law_error
    except AssertionError:
        return float("inf")


def check_lossless(name: str, vocab: int, length: int, num_paths: int, kind: str) -> None:
    """The one losslessness grid point: ``name`` on the instance of ``exact_checks.grid_seed``."""
    inst = random_instance(vocab, length, num_paths, seed=grid_seed(vocab, length, num_paths, kind), kind=kind)
    error = exact_analysis(get_verifier(name), inst).max_law_error
    assert error < LOSSLESS_TOL, f"{name} is lossy on V={vocab} L={length} K={num_paths} {kind}: {error:.3g}"


def _cases(grid: list[tuple[int, int, int, str]]) -> list[tuple[str, int, int, int, str]]:
    """Every method on every grid point it can run: the single-path methods (token, block) only where
    K = 1 (given K > 1 paths they use path 0: test_single_path_methods_ignore_extra_paths)."""
    return [(name, *point) for name in METHODS for point in grid if is_multi_path(name) or point[2] == 1]


# The grid (exact_checks.FAST / SLOW): V in {2, 3, 4}, L in {1, 2, 3}, K in {1, 2, 3}, every instance
# family, one fixed seed per point, the same instances for every verifier. It runs here once, for
# every registered verifier; the verifiers' own files keep what is theirs.
@pytest.mark.parametrize("name,vocab,length,num_paths,kind", _cases(FAST))
def test_lossless(name, vocab, length, num_paths, kind):
    check_lossless(name, vocab, length, num_paths, kind)


# The 4096-tuple points cost 75 s for gbv-adaptive and 46 s for SpecTr (its rho bisection per level);
# both are covered up to 729 tuples here and in their own files. GBV, Traversal and the rest keep them.
SLOW_CASES = [c for c in _cases(SLOW)
              if not (c[0] in ("gbv-adaptive", "spectr") and c[1] ** (c[2] * c[3]) > 729)]


@pytest.mark.slow
@pytest.mark.parametrize("name,vocab,length,num_paths,kind", SLOW_CASES)
def test_lossless_larger(name, vocab, length, num_paths, kind):
    check_lossless(name, vocab, length, num_paths, kind)


# BV and token-level sampling have two forms each: the host form (the CPU's, run by the grid above)
# and the device form (off the CPU). The device forms on the same one-path grid points: lossless, and
# the same expected accepted length as the host forms.
def _block_on_device(draft_tokens, q, p, rng) -> VerifyResult:
    from gbv.verify.block import block_verify_on_device
    from gbv.verify.common import host_ints

    check_shapes(draft_tokens, q, p)
    return VerifyResult(0, *host_ints(*block_verify_on_device(draft_tokens[0], q[0], p[0], rng)))


def _token_on_device(draft_tokens, q, p, rng) -> VerifyResult:
    from gbv.verify.token import token_verify_on_device

    check_shapes(draft_tokens, q, p)
    return VerifyResult(0, *token_verify_on_device(draft_tokens[0], q[0], p[0], rng))


@pytest.mark.parametrize("name", ["block", "token"])
@pytest.mark.parametrize("vocab,length,num_paths,kind", [point for point in FAST if point[2] == 1])
def test_single_path_device_forms_lossless(name, vocab, length, num_paths, kind):
    from exact_checks import check_device_form

    device = {"block": _block_on_device, "token": _token_on_device}[name]
    check_device_form(device, get_verifier(name), vocab, length, num_paths, kind)


@pytest.mark.parametrize("name", ["token", "block"])
def test_single_path_methods_ignore_extra_paths(name):
    """Given K > 1 paths, token and block use path 0 only: still lossless, same accepted length."""
    verifier = get_verifier(name)
    for seed in range(3):
        inst = random_instance(2, 2, 2, seed=seed, kind="mixed")
        with_extra = exact_analysis(verifier, inst, num_paths=2)
        alone = exact_analysis(verifier, inst, num_paths=1)
        assert with_extra.max_law_error < LOSSLESS_TOL
        assert with_extra.expected_accepted == pytest.approx(alone.expected_accepted, abs=1e-12)


# ---------------------------------------------------------------------- temperature 0 (SPEC section 8)
def one_hot_rows(inst: TinyInstance, table: str, seed: int) -> TinyInstance:
    """``inst`` with the rows of ``table`` ('target' or 'draft') replaced by one-hot rows at random tokens."""
    rng = np.random.default_rng(seed)
    rows = one_hot_table(getattr(inst, table), lambda row: rng.integers(inst.vocab))
    target = rows if table == "target" else inst.target
    draft = rows if table == "draft" else inst.draft
    return TinyInstance(inst.vocab, inst.block_len, inst.num_paths, target, draft)


def check_method_greedy(name: str, inst: TinyInstance) -> None:
    """:func:`exact_checks.check_greedy` on the paths the method looks at (path 0 only for token and block)."""
    check_greedy(get_verifier(name), inst, inst.num_paths if is_multi_path(name) else 1)


@pytest.mark.parametrize("name", METHODS)
def test_temperature_zero_one_hot_target_and_draft(name):
    for vocab, length, num_paths in [(2, 2, 2), (3, 2, 3), (3, 3, 2)]:
        for seed in range(4):
            base = random_instance(vocab, length, num_paths, seed=seed, kind="dirichlet")
            inst = one_hot_rows(one_hot_rows(base, "target", seed), "draft", seed + 1000)
            check_method_greedy(name, inst)


@pytest.mark.parametrize("name", METHODS)
def test_temperature_zero_target_with_sampled_draft(name):
    """Target at temperature 0, draft sampled (paths differ, some rows truncated)."""
    for vocab, length, num_paths in [(2, 2, 2), (3, 2, 2), (2, 2, 3)]:
        for seed in range(3):
            kind = "truncated" if seed % 2 else "dirichlet"
            inst = one_hot_rows(random_instance(vocab, length, num_paths, seed=seed, kind=kind), "target", seed)
            check_method_greedy(name, inst)


# ---------------------------------------------------------------------- GBV with K = 1 is BV
def test_gbv_with_one_path_is_block_verification():
    gbv_verifier, block = get_verifier("gbv"), get_verifier("block")
    for vocab, length, kind, seed in itertools.product([2, 3], [1, 2, 3], KINDS, range(2)):
        inst = random_instance(vocab, length, 1, seed=seed, kind=kind)
        for s in itertools.product(range(vocab), repeat=length):
            if inst.seq_prob(inst.draft, s) == 0.0:
                continue
            tokens, q, p = tuple_inputs(inst, [s])
            laws = []
            for verifier in (gbv_verifier, block):
                law: dict[tuple[int, int, int], float] = {}
                for result, prob in enumerate_branches(verifier, tokens, q, p):
                    key = (result.path, result.accepted_len, result.next_token)
                    law[key] = law.get(key, 0.0) + prob
                laws.append({k: v for k, v in law.items() if v > 0.0})
            assert laws[0].keys() == laws[1].keys(), f"V={vocab} L={length} {kind} seed {seed} path {s}"
            for key, prob in laws[1].items():
                assert laws[0][key] == pytest.approx(prob, abs=1e-14), f"{key} on path {s}"


# ---------------------------------------------------------------------- negative controls
def reference_block(draft_tokens, q, p, rng, h_shift: int = 0) -> VerifyResult:
    """BV on path 0 written out from SPEC section 2; ``h_shift = 1`` is the off-by-one bug
    ``h_i = r_i / (r_i + 1 - w_{i-1})`` (weights shifted by one in the acceptance probabilities)."""
    _, length, _ = check_shapes(draft_tokens, q, p)
    tokens, q0, p0 = draft_tokens[0], q[0], p[0]
    ratios = (on_path_probs(p0[:length], tokens) / on_path_probs(q0, tokens)).tolist()
    w = [1.0]
    for ratio in ratios:
        w.append(min(1.0, w[-1] * ratio))
    h = [0.0] * (length + 1)
    h[length] = w[length - h_shift]
    for i in range(1, length):
        r = float((w[i] * p0[i] - q0[i]).clamp_min(0.0).sum())
        denom = r + 1.0 - w[i - h_shift]
        h[i] = 1.0 if denom <= 0.0 else min(1.0, r / denom)
    tau = next((i for i in range(length, 0, -1) if rng.accept(h[i])), 0)
    if tau == length:
        return VerifyResult(0, tau, rng.sample(p0[length]))
    return VerifyResult(0, tau, rng.sample(residual(p0[tau], q0[tau], w[tau])))


def reference_token(draft_tokens, q, p, rng, bug: str | None = None) -> VerifyResult:
    """Token-level sampling on path 0 (SPEC section 1). Bugs: ``"unclamped"`` samples from
    ``norm(p - q)`` without ``(.)+``; ``"from_p"`` samples the correction from ``p``."""
    _, length, _ = check_shapes(draft_tokens, q, p)
    tokens, q0, p0 = draft_tokens[0], q[0], p[0]
    for i in range(length):
        x = int(tokens[i])
        if not rng.accept(min(1.0, float(p0[i, x] / q0[i, x]))):
            if bug == "unclamped":
                diff = p0[i] - q0[i]
                dist = diff / diff.sum() if float(diff.sum()) != 0.0 else p0[i]
            elif bug == "from_p":
                dist = p0[i]
            else:
                dist = residual(p0[i], q0[i])
            return VerifyResult(0, i, rng.sample(dist))
    return VerifyResult(0, length, rng.sample(p0[length]))


CONTROL_SHAPES = [(2, 2, 1), (3, 2, 1), (2, 3, 1), (3, 1, 1)]


def master_check_fails(verifier) -> bool:
    """The master test's check on a share of its instances: does any instance show a law error?"""
    return any(law_error(verifier, random_instance(v, l, k, seed=seed, kind=kind), 1) >= LOSSLESS_TOL
               for v, l, k in CONTROL_SHAPES for kind in ("mixed", "truncated") for seed in range(4))


def test_reference_controls_are_lossless_without_the_bug():
    assert not master_check_fails(reference_block)
    assert not master_check_fails(reference_token)


def test_master_check_catches_off_by_one_block_verification():
    assert master_check_fails(lambda t, q, p, rng: reference_block(t, q, p, rng, h_shift=1))


@pytest.mark.parametrize("bug", ["unclamped", "from_p"])
def test_master_check_catches_broken_token_sampler(bug):
    assert master_check_fails(lambda t, q, p, rng: reference_token(t, q, p, rng, bug=bug))


@pytest.mark.parametrize("form", ["host", "device"])
def test_master_check_catches_monkeypatched_production_block(form, monkeypatch):
    """The production BV, in each of its forms (host: the CPU's; device: off the CPU, forced here),
    with its residual taken unscaled (weight ignored)."""
    import gbv.verify.block as block_module

    assert not master_check_fails(get_verifier("block"))  # the form as it is passes the same check
    if form == "device":
        monkeypatch.setattr(block_module, "uses_device_form", lambda p: True)
        assert not master_check_fails(get_verifier("block"))
        real_residual = block_module.residual_on_device
        monkeypatch.setattr(block_module, "residual_on_device", lambda p, q, scale=1.0: real_residual(p, q))
    else:
        real_part = block_module.positive_part_and_sum
        monkeypatch.setattr(block_module, "positive_part_and_sum", lambda p, q, w: real_part(p, q, 1.0))
    assert master_check_fails(get_verifier("block"))


@pytest.mark.parametrize("form", ["host", "device"])
def test_master_check_catches_monkeypatched_production_token(form, monkeypatch):
    """The production token-level sampler, in each form, with its correction drawn from ``p`` alone
    (``q`` ignored)."""
    import gbv.verify.token as token_module

    if form == "device":
        monkeypatch.setattr(token_module, "uses_device_form", lambda p: True)
        assert not master_check_fails(get_verifier("token"))
        real_residual = token_module.residual_on_device
        monkeypatch.setattr(token_module, "residual_on_device", lambda p, q, scale=1.0: real_residual(p, 0.0 * q))
    else:
        assert not master_check_fails(get_verifier("token"))
        monkeypatch.setattr(token_module, "positive_part_and_sum", lambda p, q, w: (p.astype(np.float64), float(p.sum())))
    assert master_check_fails(get_verifier("token"))
