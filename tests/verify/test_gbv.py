"""GBV (SPEC section 3): lossless by exact enumeration, reference values, reduction to BV, the skewed
draft law against brute force, numerical stability, temperature 0, and a negative control."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np
import pytest
import torch

import gbv.verify.gbv as gbv_module
from gbv.theory import context_free_instance, enumerate_branches, exact_analysis, random_instance
from gbv.verify import TorchRandom, get_verifier
from gbv.verify.gbv import ranking_key, select_path, skewed_draft_law, verify_gbv

from exact_checks import KINDS, LOSSLESS_TOL, path_tensors, tuple_inputs


def _shapes(max_tuples: int, min_tuples: int = 0) -> list[tuple[int, int, int]]:
    return [(v, l, k) for v in (2, 3, 4) for l in (1, 2, 3) for k in (1, 2, 3)
            if min_tuples < v ** (l * k) <= max_tuples]


def _seed(vocab: int, block_len: int, num_paths: int, kind: str, rep: int = 0) -> int:
    return 1000 * rep + 100 * vocab + 10 * block_len + num_paths + 7 * KINDS.index(kind)


# ---------------------------------------------------------------------------------------------- 1
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab,block_len,num_paths", _shapes(729))
def test_lossless_by_exact_enumeration(vocab, block_len, num_paths, kind):
    inst = random_instance(vocab, block_len, num_paths, seed=_seed(vocab, block_len, num_paths, kind), kind=kind)
    result = exact_analysis(get_verifier("gbv"), inst)
    assert result.max_law_error < LOSSLESS_TOL
    assert -1e-12 <= result.expected_accepted <= block_len + 1e-12


# One more seed of every fast shape, the V^(LK) = 4096 shapes (one mixed instance each: ~10 s each
# on an idle 2-core machine), and larger K on a short block.
SLOW_CASES = ([(v, l, k, 1, kind) for v, l, k in _shapes(729) for kind in KINDS]
              + [(v, l, k, 0, "mixed") for v, l, k in ((4, 2, 3), (4, 3, 2), (2, 3, 4))]
              + [(3, 1, 7, 0, "mixed"), (2, 2, 6, 0, "equal")])


@pytest.mark.slow
@pytest.mark.parametrize("vocab,block_len,num_paths,rep,kind", SLOW_CASES)
def test_lossless_by_exact_enumeration_slow(vocab, block_len, num_paths, rep, kind):
    inst = random_instance(vocab, block_len, num_paths, seed=_seed(vocab, block_len, num_paths, kind, rep),
                           kind=kind)
    assert exact_analysis(get_verifier("gbv"), inst).max_law_error < LOSSLESS_TOL


# ---------------------------------------------------------------------------------------------- 2
@pytest.mark.parametrize("num_paths,expected", [(1, 11 / 9), (2, 131 / 81), (3, 1289 / 729)])
def test_spec_reference_values(num_paths, expected):
    inst = context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2, num_paths)
    result = exact_analysis(get_verifier("gbv"), inst)
    assert abs(result.expected_accepted - expected) < 1e-12
    assert result.max_law_error < 1e-12


# ---------------------------------------------------------------------------------------------- 3
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab,block_len", [(2, 3), (3, 2), (4, 3)])
def test_single_path_equals_block_verification(vocab, block_len, kind):
    inst = random_instance(vocab, block_len, 1, seed=_seed(vocab, block_len, 1, kind, 3), kind=kind)
    gbv_res = exact_analysis(get_verifier("gbv"), inst)
    bv_res = exact_analysis(get_verifier("block"), inst)
    assert gbv_res.expected_accepted == bv_res.expected_accepted
    assert gbv_res.emitted_law.keys() == bv_res.emitted_law.keys()
    for out, mass in bv_res.emitted_law.items():
        assert gbv_res.emitted_law[out] == mass


def test_single_path_branches_equal_block_verification_large_vocab():
    gen = torch.Generator().manual_seed(0)
    block_len, vocab = 4, 50
    q = torch.softmax(3 * torch.randn(1, block_len, vocab, generator=gen, dtype=torch.float64), -1)
    p = torch.softmax(3 * torch.randn(1, block_len + 1, vocab, generator=gen, dtype=torch.float64), -1)
    tokens = torch.multinomial(q[0], 1, generator=gen).T
    assert torch.equal(skewed_draft_law(tokens[0], q[0], p[0], 1), q[0])
    gbv_leaves = enumerate_branches(get_verifier("gbv"), tokens, q, p)
    bv_leaves = enumerate_branches(get_verifier("block"), tokens, q, p)
    assert gbv_leaves == bv_leaves


# ---------------------------------------------------------------------------------------------- 4
BRUTE_FORCE_CASES = [
    ("context_free", 2, 2, 3, None),
    ("mixed", 3, 2, 3, 11), ("equal", 3, 2, 3, 12), ("truncated", 3, 2, 3, 13), ("sharp", 3, 2, 3, 14),
    ("mixed", 2, 3, 3, 21), ("equal", 2, 3, 2, 22), ("mixed", 4, 2, 2, 23), ("dirichlet", 3, 1, 5, 24),
]


@pytest.mark.parametrize("kind,vocab,block_len,num_paths,seed", BRUTE_FORCE_CASES)
def test_skewed_law_matches_brute_force_selection(kind, vocab, block_len, num_paths, seed):
    if kind == "context_free":
        inst = context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], block_len, num_paths)
    else:
        inst = random_instance(vocab, block_len, num_paths, seed=seed, kind=kind)
    seqs = list(itertools.product(range(vocab), repeat=block_len))
    probs = {s: inst.seq_prob(inst.draft, s) for s in seqs}
    # Brute force: every K-tuple of drafted paths, the selection rule, and the tuple's probability.
    selected_law: dict[tuple[int, ...], float] = defaultdict(float)
    for combo in itertools.product([s for s in seqs if probs[s] > 0], repeat=num_paths):
        paths = list(combo)
        selected_law[paths[select_path(*tuple_inputs(inst, paths))]] += math.prod(probs[s] for s in paths)
    assert abs(sum(selected_law.values()) - 1.0) < 1e-12
    for s in seqs:
        q_path, p_path = path_tensors(inst, s)
        q_g = skewed_draft_law(torch.tensor(s), q_path, p_path, num_paths)
        assert torch.all(q_g >= 0) and torch.allclose(q_g.sum(-1), torch.ones(block_len, dtype=torch.float64),
                                                      atol=1e-12, rtol=0)
        law = math.prod(float(q_g[i, s[i]]) for i in range(block_len))
        assert abs(law - selected_law.get(s, 0.0)) < 1e-12, s


def _lexicographic_best(draft_tokens, q, p) -> int:
    """Independent statement of the selection rule: compare paths pairwise in plain Python floats."""
    def better(a: int, b: int) -> bool:  # is path a ranked strictly above path b?
        for d in range(draft_tokens.shape[1]):
            ta, tb = int(draft_tokens[a, d]), int(draft_tokens[b, d])
            if ta != tb:
                ka = float(p[a, d, ta]) / float(q[a, d, ta])
                kb = float(p[b, d, tb]) / float(q[b, d, tb])
                return ka > kb or (ka == kb and ta < tb)
        return False
    best = 0
    for k in range(1, draft_tokens.shape[0]):
        if better(k, best):
            best = k
    return best


def test_select_path_is_the_lexicographic_maximum():
    rng = np.random.default_rng(1)
    for trial in range(200):
        num_paths, block_len, vocab = 2 + trial % 5, 1 + trial % 4, 2 + trial % 3
        inst = random_instance(vocab, block_len, num_paths, seed=trial, kind="mixed")  # has ties and zeros
        paths = []
        for _ in range(num_paths):  # drafted from the instance's q
            path: tuple[int, ...] = ()
            for _d in range(block_len):
                path += (int(rng.choice(vocab, p=inst.draft[path])),)
            paths.append(path)
        draft_tokens, q, p = tuple_inputs(inst, paths)
        assert select_path(draft_tokens, q, p) == _lexicographic_best(draft_tokens, q, p)


# ---------------------------------------------------------------------------------------------- 5
def _heavy_tailed(gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Rows with entries spread log-uniformly over [1e-30, 1], some exact zeros and a few ties."""
    dist = torch.pow(10.0, -30.0 * torch.rand(shape, generator=gen, dtype=torch.float64))
    dist[torch.rand(shape, generator=gen) < 0.05] = 0.0
    dist[..., :3] = dist[..., 3:4]  # ties
    dist[..., 4] = 1e-30
    return dist / dist.sum(-1, keepdim=True)


@pytest.mark.parametrize("drafted", [True, False])
def test_skewed_law_is_stable(drafted):
    gen = torch.Generator().manual_seed(2)
    block_len, num_paths, vocab = 32, 16, 1000
    q = _heavy_tailed(gen, (block_len, vocab))
    p = _heavy_tailed(gen, (block_len + 1, vocab))
    if drafted:
        tokens = torch.multinomial(q, 1, generator=gen).squeeze(-1)
    else:  # random paths, including tokens of tiny or zero q-mass
        tokens = torch.randint(vocab, (block_len,), generator=gen)
        tokens[::4] = 4
    q_g = skewed_draft_law(tokens, q, p, num_paths)
    assert q_g.shape == (block_len, vocab) and q_g.dtype == torch.float64
    assert torch.all(torch.isfinite(q_g)) and torch.all(q_g >= 0)
    assert torch.allclose(q_g.sum(-1), torch.ones(block_len, dtype=torch.float64), atol=1e-9, rtol=0)
    assert torch.all(q_g[q == 0] == 0)
    # The full verifier on the same kind of inputs, float32 as in production.
    draft_tokens = torch.stack([tokens] + [torch.multinomial(q, 1, generator=gen).squeeze(-1)
                                           for _ in range(num_paths - 1)])
    q_k = q.float().expand(num_paths, -1, -1)
    p_k = p.float().expand(num_paths, -1, -1)
    result = verify_gbv(draft_tokens, q_k, p_k, TorchRandom(seed=0))
    assert result.path == select_path(draft_tokens, q_k, p_k)
    assert 0 <= result.accepted_len <= block_len and 0 <= result.next_token < vocab


def test_skewed_law_float32_inputs():
    gen = torch.Generator().manual_seed(3)
    block_len, num_paths, vocab = 6, 4, 300
    q = torch.softmax(2 * torch.randn(block_len, vocab, generator=gen), -1)
    p = torch.softmax(2 * torch.randn(block_len + 1, vocab, generator=gen), -1)
    tokens = torch.multinomial(q, 1, generator=gen).squeeze(-1)
    q_g32 = skewed_draft_law(tokens, q, p, num_paths)
    q_g64 = skewed_draft_law(tokens, q.double(), p.double(), num_paths)
    assert q_g32.dtype == torch.float64
    assert torch.equal(q_g32, q_g64)  # float32 inputs are converted exactly, the rest is float64


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("vocab", [5, 3000])
def test_rank_order_is_the_stable_sort_of_the_key(vocab, dtype):
    """The CPU fast paths (numpy) give exactly the stable order of the key, ties included."""
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(6, vocab, generator=gen, dtype=dtype), -1)
    q = torch.softmax(torch.randn(6, vocab, generator=gen, dtype=dtype), -1)
    p[0], q[1, ::3], p[2, ::2], q[2, 1::4], p[3] = q[0], 0.0, 0.0, 0.0, 0.0  # ties, +inf and 0/0 tokens
    p[4, : vocab // 2] = q[4, : vocab // 2] * 0.5  # a long run of equal ratios
    p[5, 1::2] = -0.0  # signed zeros must tie with +0.0
    assert ranking_key(p, q).dtype == dtype
    expected = torch.sort(-ranking_key(p, q), dim=-1, stable=True).indices
    assert torch.equal(gbv_module._rank_order(p, q), expected)
    assert torch.equal(torch.from_numpy(gbv_module._stable_argsort_rows((-ranking_key(p, q)).numpy())), expected)


# ---------------------------------------------------------------------------------------------- 6
def _one_hot(token: int, vocab: int, dtype) -> torch.Tensor:
    row = torch.zeros(vocab, dtype=dtype)
    row[token] = 1.0
    return row


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_temperature_zero_is_longest_argmax_match(dtype):
    rng = np.random.default_rng(4)
    verifier = get_verifier("gbv")
    for _ in range(150):
        num_paths, block_len, vocab = int(rng.integers(1, 5)), int(rng.integers(1, 5)), int(rng.integers(2, 6))
        argmax_table: dict[tuple[int, ...], int] = {}

        def target_argmax(prefix: tuple[int, ...]) -> int:
            if prefix not in argmax_table:
                argmax_table[prefix] = int(rng.integers(vocab))
            return argmax_table[prefix]

        paths = []
        for _k in range(num_paths):
            path: list[int] = []
            for _d in range(block_len):
                good = target_argmax(tuple(path))
                path.append(good if rng.random() < 0.6 else int(rng.integers(vocab)))
            paths.append(tuple(path))
        draft_tokens = torch.tensor(paths, dtype=torch.long)
        # Each path's q row is one-hot at its own token (rows may differ between paths at a shared
        # prefix); p is one-hot at the target argmax of the prefix.
        q = torch.stack([torch.stack([_one_hot(s[d], vocab, dtype) for d in range(block_len)]) for s in paths])
        p = torch.stack([torch.stack([_one_hot(target_argmax(s[:d]), vocab, dtype) for d in range(block_len + 1)])
                         for s in paths])

        def match_len(s: tuple[int, ...]) -> int:
            n = 0
            while n < block_len and s[n] == target_argmax(s[:n]):
                n += 1
            return n

        longest = max(match_len(s) for s in paths)
        leaves = enumerate_branches(verifier, draft_tokens, q, p)
        assert abs(sum(prob for _, prob in leaves) - 1.0) < 1e-12
        for result, prob in leaves + [(verifier(draft_tokens, q, p, TorchRandom(seed=0)), 1.0)]:
            assert prob > 0
            chosen = paths[result.path]
            assert result.accepted_len == longest
            assert match_len(chosen) == longest
            assert result.next_token == target_argmax(chosen[:longest])


# ---------------------------------------------------------------------------------------------- 7
def _rank_order_ties_reversed(p_path, q_path):
    """Broken: same ratios, but ties go to the *larger* token id (selection uses the smaller)."""
    vocab = q_path.shape[-1]
    flipped = torch.sort(-ranking_key(p_path, q_path).flip(-1), dim=-1, stable=True).indices
    return vocab - 1 - flipped


def _rank_order_by_q(p_path, q_path):
    """Broken: ranks by q alone, ignoring p."""
    return torch.sort(-q_path.to(torch.float64), dim=-1, stable=True).indices


NEGATIVE_CONTROL_INSTANCES = [("equal", 3, 2, 2, 31), ("mixed", 3, 2, 2, 32), ("dirichlet", 2, 2, 3, 33),
                              ("sharp", 3, 1, 3, 34)]


@pytest.mark.parametrize("broken", [_rank_order_ties_reversed, _rank_order_by_q])
def test_inconsistent_ranking_is_detected(monkeypatch, broken):
    instances = [random_instance(v, l, k, seed=seed, kind=kind) for kind, v, l, k, seed in NEGATIVE_CONTROL_INSTANCES]
    verifier = get_verifier("gbv")
    assert max(exact_analysis(verifier, inst).max_law_error for inst in instances) < LOSSLESS_TOL
    monkeypatch.setattr(gbv_module, "_rank_order", broken)
    assert max(exact_analysis(verifier, inst).max_law_error for inst in instances) > 1e-6
