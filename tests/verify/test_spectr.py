"""SpecTr K-SEQ (SPEC section 5).

Exact losslessness by enumeration (:func:`gbv.theory.exact_analysis` replays every branch of the very
verifier code), SPEC section 10 values, temperature 0 (SPEC section 8), the choice of rho, and a
negative control: rho = 1 with k > 1 must be caught by the same exact check. The checks shared with
the other multi-path verifiers come from ``exact_checks``.
"""

from __future__ import annotations

import pytest
import torch

from gbv.verify import get_verifier
from gbv.verify import spectr
from gbv.verify.spectr import _kseq_residual, _smallest_rho, verify_spectr

from exact_checks import check_reference_value, max_error_on_negative_set, verifier_fixture
# The exact checks shared with the other multi-path verifiers, collected here as this file's tests:
from exact_checks import test_single_path_is_token_level  # noqa: F401
from exact_checks import test_temperature_zero, test_greedy_target_sampled_draft  # noqa: F401
from exact_checks import test_negative_control_set_is_lossless_unpatched, test_large_vocab_embeds_tiny  # noqa: F401

verifier = verifier_fixture(verify_spectr)  # what the shared tests run on


@pytest.mark.parametrize("num_paths,expected", [(1, 10 / 9), (2, 1.405487), (3, 1.593306)])
def test_spec_reference_values(num_paths, expected):
    check_reference_value(verify_spectr, num_paths, expected, tol=1e-6)


def test_registry():
    assert get_verifier("spectr") is verify_spectr


# ---------------------------------------------------------------------- negative control
def test_rho_one_for_several_draws_is_caught(monkeypatch):
    monkeypatch.setattr(spectr, "_smallest_rho", lambda p, q, k: 1.0)
    assert max_error_on_negative_set(verify_spectr) > 1e-6


# ---------------------------------------------------------------------- the choice of rho
def _beta(p: torch.Tensor, q: torch.Tensor, rho: float) -> float:
    return float(torch.minimum(q, p / rho).sum())


def _excess(p: torch.Tensor, q: torch.Tensor, rho: float, k: int) -> float:
    beta = _beta(p, q, rho)
    return rho * beta - (1.0 - (1.0 - beta) ** k)


def _random_pair(vocab: int, seed: int, zeros: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    q = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    if zeros:  # tokens with q = 0 < p (ratio inf) and with p = q = 0 (ratio NaN)
        q[0] = 0.0
        p[1] = q[1] = 0.0
        p[2] = 0.0
    return p / p.sum(), q / q.sum()


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("k", [2, 3, 5, 16])
def test_smallest_rho_is_valid_and_smallest(seed, k):
    p, q = _random_pair(7 + seed, seed, zeros=seed % 2 == 1)
    rho = _smallest_rho(p, q, k)
    assert 1.0 <= rho <= k
    assert _excess(p, q, rho, k) >= 0.0  # the inequality holds at the returned value (lossless)
    if rho > 1.0:  # and fails just below it (smallest, to the documented tolerance)
        assert _excess(p, q, rho * (1.0 - 1e-9), k) < 0.0
    # the K-SEQ residual is a proper distribution without clamping anything material
    overlap = torch.minimum(q, p / rho)
    beta = float(overlap.sum())
    raw = p - overlap * (1.0 - (1.0 - beta) ** k) / beta
    assert float(raw.min()) > -1e-12
    assert abs(float(raw.sum()) - (1.0 - beta) ** k) < 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_smallest_rho_of_float32_rows_is_valid_and_smallest_in_float64(seed):
    """The engine passes float32 rows (V = 4096 here, softmax-shaped); the root search runs on float64
    copies of them, so the returned rho satisfies the inequality for those rows exactly as float64
    computes it, and is the smallest such (the search in the rows' float32 missed on 98 of 238
    engine rows, in both directions)."""
    gen = torch.Generator().manual_seed(200 + seed)
    logits = 2.0 * torch.randn(4096, generator=gen)
    p = torch.softmax(logits + torch.randn(4096, generator=gen), -1)
    q = torch.softmax(logits, -1)
    p64, q64 = p.double(), q.double()
    for k in (2, 3, 4):
        rho = _smallest_rho(p, q, k)
        assert 1.0 < rho <= k
        assert _excess(p64, q64, rho, k) >= 0.0
        assert _excess(p64, q64, rho * (1.0 - 1e-9), k) < 0.0


def test_smallest_rho_matches_plain_bisection():
    for seed in range(8):
        p, q = _random_pair(50, 100 + seed, zeros=False)
        for k in (2, 4):
            lo, hi = 1.0, float(k)
            if _excess(p, q, 1.0, k) >= 0:
                hi = 1.0
            for _ in range(100):
                mid = 0.5 * (lo + hi)
                lo, hi = (lo, mid) if _excess(p, q, mid, k) >= 0 else (mid, hi)
            assert _smallest_rho(p, q, k) == pytest.approx(hi, rel=1e-10)


def test_rho_edge_cases():
    p = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    q_disjoint = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    assert _smallest_rho(p, q_disjoint, 3) == 1.0  # beta = 0
    assert torch.equal(_kseq_residual(p, q_disjoint, 1.0, 3), p)
    assert _smallest_rho(p, p.clone(), 3) == 1.0  # p = q
    assert _smallest_rho(p, torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64), 1) == 1.0  # k = 1
    hot_a = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    hot_b = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    assert _smallest_rho(hot_a, hot_a, 4) == 1.0
    assert _smallest_rho(hot_a, hot_b, 4) == 1.0
    assert torch.equal(_kseq_residual(hot_a, hot_b, 1.0, 4), hot_a)
    # one-hot target, stochastic draft: closed form rho = (1 - (1 - q(a))^k) / q(a)
    q = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    assert _smallest_rho(hot_a, q, 3) == pytest.approx((1 - 0.75 ** 3) / 0.25, rel=1e-12)
    for rho_p, rho_q in [(hot_a, hot_b), (hot_a, q), (p, q_disjoint)]:
        res = _kseq_residual(rho_p, rho_q, _smallest_rho(rho_p, rho_q, 3), 3)
        assert not torch.isnan(res).any() and abs(float(res.sum()) - 1.0) < 1e-12
