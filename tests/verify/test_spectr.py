"""SpecTr K-SEQ (SPEC section 5).

Exact losslessness by enumeration (:func:`gbv.theory.exact_analysis` replays every branch of the very
verifier code), SPEC section 10 values, temperature 0 (SPEC section 8), the choice of rho, and a
negative control: rho = 1 with k > 1 must be caught by the same exact check.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from gbv.theory import context_free_instance, enumerate_branches, exact_analysis, random_instance
from gbv.theory.instance import TinyInstance
from gbv.verify import TorchRandom, get_verifier
from gbv.verify import spectr
from gbv.verify.spectr import _kseq_residual, _smallest_rho, verify_spectr
from gbv.verify.token import verify_token

KINDS = ("mixed", "truncated", "equal", "sharp")
LOSSLESS_TOL = 1e-9
# (V, L, K) with V^(L*K) draft tuples: up to 256 in the fast set; the largest sizes go to the slow set.
SIZES = [(v, l, k) for v in (2, 3, 4) for l in (1, 2, 3) for k in (1, 2, 3)]
FAST = [(v, l, k, kind) for v, l, k in SIZES if v ** (l * k) <= 256 for kind in KINDS]
FAST += [(v, l, k, "mixed") for v, l, k in SIZES if 256 < v ** (l * k) <= 729]
SLOW = [(v, l, k, kind) for v, l, k in SIZES if 256 < v ** (l * k) <= 729 for kind in KINDS if kind != "mixed"]
# The 4096-tuple shapes cost ~10 s each: one mixed instance (rows of every kind) per shape.
SLOW += [(v, l, k, "mixed") for v, l, k in SIZES if 729 < v ** (l * k) <= 4096]


def _seed(vocab: int, block_len: int, num_paths: int, kind: str) -> int:
    return 1000 * vocab + 100 * block_len + 10 * num_paths + KINDS.index(kind)


def _lossless(vocab: int, block_len: int, num_paths: int, kind: str) -> None:
    inst = random_instance(vocab, block_len, num_paths, _seed(vocab, block_len, num_paths, kind), kind)
    assert exact_analysis(verify_spectr, inst).max_law_error < LOSSLESS_TOL


@pytest.mark.parametrize("vocab,block_len,num_paths,kind", FAST)
def test_lossless_exact(vocab, block_len, num_paths, kind):
    _lossless(vocab, block_len, num_paths, kind)


@pytest.mark.slow
@pytest.mark.parametrize("vocab,block_len,num_paths,kind", SLOW)
def test_lossless_exact_large(vocab, block_len, num_paths, kind):
    _lossless(vocab, block_len, num_paths, kind)


@pytest.mark.parametrize("num_paths,expected", [(1, 10 / 9), (2, 1.405487), (3, 1.593306)])
def test_spec_reference_values(num_paths, expected):
    inst = context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2, num_paths)
    result = exact_analysis(verify_spectr, inst)
    assert result.expected_accepted == pytest.approx(expected, abs=1e-6)
    assert result.max_law_error < 1e-12


@pytest.mark.parametrize("vocab,block_len,seed", [(3, 2, 0), (4, 3, 1), (2, 3, 2)])
def test_single_path_is_token_level(vocab, block_len, seed):
    inst = random_instance(vocab, block_len, 1, seed, "mixed")
    ours, ref = exact_analysis(verify_spectr, inst), exact_analysis(verify_token, inst)
    assert ours.expected_accepted == pytest.approx(ref.expected_accepted, abs=1e-12)
    for out in set(ours.emitted_law) | set(ref.emitted_law):
        assert ours.emitted_law.get(out, 0.0) == pytest.approx(ref.emitted_law.get(out, 0.0), abs=1e-12)


def test_registry():
    assert get_verifier("spectr") is verify_spectr


# ---------------------------------------------------------------------- temperature 0 (SPEC section 8)
def _one_hot(table: dict) -> dict:
    out = {}
    for ctx, row in table.items():
        hot = np.zeros_like(row)
        hot[int(np.argmax(row))] = 1.0
        out[ctx] = hot
    return out


def _check_greedy(verifier, inst: TinyInstance) -> int:
    """Every branch of every draft tuple: longest argmax-matching drafted prefix, then the argmax."""
    length, vocab, num_paths = inst.block_len, inst.vocab, inst.num_paths
    argmax = {ctx: int(np.argmax(row)) for ctx, row in inst.target.items()}

    def matched(seq):
        m = 0
        while m < length and argmax[seq[:m]] == seq[m]:
            m += 1
        return m

    seqs = [s for s in itertools.product(range(vocab), repeat=length) if inst.seq_prob(inst.draft, s) > 0]
    checked = 0
    for combo in itertools.product(seqs, repeat=num_paths):
        tokens = torch.tensor(combo, dtype=torch.long).reshape(num_paths, length)
        q = torch.stack([torch.from_numpy(np.stack([inst.draft[s[:i]] for i in range(length)])) for s in combo])
        p = torch.stack([torch.from_numpy(np.stack([inst.target[s[:i]] for i in range(length + 1)]))
                         for s in combo])
        best = max(matched(s) for s in combo)
        for result, _ in enumerate_branches(verifier, tokens, q, p):
            seq = combo[result.path]
            assert result.accepted_len == best and matched(seq) >= best, (combo, result)
            assert result.next_token == argmax[seq[:best]], (combo, result)
            checked += 1
    return checked


@pytest.mark.parametrize("vocab,block_len,num_paths,seed", [(3, 2, 3, 0), (2, 3, 2, 1), (4, 1, 3, 2), (4, 3, 1, 3)])
def test_temperature_zero(vocab, block_len, num_paths, seed):
    base = random_instance(vocab, block_len, num_paths, seed, "mixed")
    greedy = TinyInstance(vocab, block_len, num_paths, _one_hot(base.target), _one_hot(base.draft))
    assert _check_greedy(verify_spectr, greedy) >= 1


@pytest.mark.parametrize("kind", ["mixed", "sharp", "truncated"])
def test_greedy_target_sampled_draft(kind):
    """One-hot p, stochastic q (paths differ): still the longest matching prefix over all paths."""
    base = random_instance(3, 2, 3, 7, kind)
    inst = TinyInstance(3, 2, 3, _one_hot(base.target), base.draft)
    assert _check_greedy(verify_spectr, inst) >= 1


# ---------------------------------------------------------------------- negative control
NEGATIVE_INSTANCES = [(3, 1, 2, 0), (3, 1, 2, 1), (4, 1, 3, 0), (3, 2, 2, 0)]


def _max_error_on_negative_set() -> float:
    return max(exact_analysis(verify_spectr, random_instance(v, l, k, s, "dirichlet")).max_law_error
               for v, l, k, s in NEGATIVE_INSTANCES)


def test_negative_control_set_is_lossless_unpatched():
    assert _max_error_on_negative_set() < LOSSLESS_TOL


def test_rho_one_for_several_draws_is_caught(monkeypatch):
    monkeypatch.setattr(spectr, "_smallest_rho", lambda p, q, k: 1.0)
    assert _max_error_on_negative_set() > 1e-6


# ---------------------------------------------------------------------- production use
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_vocab_smoke(dtype):
    gen = torch.Generator().manual_seed(0)
    num_paths, block_len, vocab = 4, 3, 50_000
    q = torch.softmax(torch.randn(num_paths, block_len, vocab, generator=gen, dtype=dtype) * 3, -1)
    p = torch.softmax(torch.randn(num_paths, block_len + 1, vocab, generator=gen, dtype=dtype) * 3, -1)
    tokens = torch.stack([torch.multinomial(q[k], 1, generator=gen).squeeze(-1) for k in range(num_paths)])
    for seed in range(5):
        result = verify_spectr(tokens, q, p, TorchRandom(seed=seed))
        assert 0 <= result.path < num_paths and 0 <= result.accepted_len <= block_len
        assert 0 <= result.next_token < vocab


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
