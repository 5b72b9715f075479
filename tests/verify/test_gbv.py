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
from gbv.verify import ranking
from gbv.theory import context_free_instance, enumerate_branches, exact_analysis, random_instance
from gbv.verify import TorchRandom, get_verifier
from gbv.verify.block import block_verify_core
from gbv.verify.common import VerifyResult, on_path_probs, residual, resolve_refinements
from gbv.verify.gbv import (ranking_key, select_path, select_path_on_device, skewed_draft_law,
                            skewed_law_rows_on_device, verify_gbv, verify_gbv_on_device)

from exact_checks import (FAST, KINDS, LOSSLESS_TOL, check_device_form, check_same_outcome_laws, coarse_buckets,
                          path_tensors, tuple_inputs)


def _seed(vocab: int, block_len: int, num_paths: int, kind: str, rep: int = 0) -> int:
    return 1000 * rep + 100 * vocab + 10 * block_len + num_paths + 7 * KINDS.index(kind)


# ---------------------------------------------------------------------------------------------- 1
# Losslessness on every instance family runs in test_lossless.py's master grid (K <= 3); here only
# larger K on short blocks, beyond that grid.
@pytest.mark.slow
@pytest.mark.parametrize("vocab,block_len,num_paths,kind", [(3, 1, 7, "mixed"), (2, 2, 6, "equal"), (2, 3, 4, "mixed")])
def test_lossless_with_many_paths(vocab, block_len, num_paths, kind):
    inst = random_instance(vocab, block_len, num_paths, seed=_seed(vocab, block_len, num_paths, kind), kind=kind)
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


def _brute_force_instance(kind, vocab, block_len, num_paths, seed):
    """The instance of one BRUTE_FORCE_CASES row."""
    if kind == "context_free":
        return context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], block_len, num_paths)
    return random_instance(vocab, block_len, num_paths, seed=seed, kind=kind)


@pytest.mark.parametrize("kind,vocab,block_len,num_paths,seed", BRUTE_FORCE_CASES)
def test_skewed_law_matches_brute_force_selection(kind, vocab, block_len, num_paths, seed):
    inst = _brute_force_instance(kind, vocab, block_len, num_paths, seed)
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
    assert torch.equal(ranking.rank_order(ranking_key(p, q)), expected)
    assert torch.equal(torch.from_numpy(ranking._stable_argsort_rows((-ranking_key(p, q)).numpy())), expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("count", [7, 400, 2500])  # both sorts of mass_below_among (lexsort up to 1000)
def test_mass_below_among_is_the_exact_mass_below_on_the_listed_tokens(count, dtype):
    """The exact W of a subset of a node's tokens, listed in increasing id order (residual_row's
    candidates, gbv-adaptive's cut row): what mass_below_rows gives on those tokens alone, ties,
    +inf and 0/0 keys included."""
    gen = torch.Generator().manual_seed(6)
    p = torch.softmax(torch.randn(count, generator=gen, dtype=dtype), -1)
    q = torch.softmax(torch.randn(count, generator=gen, dtype=dtype), -1)
    p[: count // 3] = q[: count // 3] * 0.5  # a run of equal keys
    q[count // 2] = 0.0  # +inf
    p[-1] = q[-1] = 0.0  # 0 / 0
    key, q64 = ranking_key(p, q), q.double()
    expected = ranking.mass_below_rows(key[None], q64[None])[0].numpy()
    ours = ranking.mass_below_among(key.numpy(), q64.numpy())
    assert np.abs(ours - expected).max() < 1e-15


# ---------------------------------------------------------------------------------------------- 6
def _one_hot(token: int, vocab: int, dtype) -> torch.Tensor:
    row = torch.zeros(vocab, dtype=dtype)
    row[token] = 1.0
    return row


@pytest.mark.parametrize("verifier", [verify_gbv, verify_gbv_on_device], ids=["host", "device"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_temperature_zero_is_longest_argmax_match(dtype, verifier):
    rng = np.random.default_rng(4)
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
def _mass_below_ties_reversed(key, q64, tokens):
    """Broken: same keys, but ties ranked the other way (larger id better) in the law only. numpy
    rows and a list of token ids, as the host form calls ``mass_below_array``."""
    ids = np.arange(key.shape[-1])
    return np.array([q64[row] @ ((key[row] < key[row, token]) | ((key[row] == key[row, token]) & (ids < token)))
                     for row, token in enumerate(tokens)])


def _mass_below_by_q(key, q64, tokens):
    """Broken: the law ranks by q alone (the selection still by p / q)."""
    return ranking.mass_below_array(q64.astype(np.float64), q64, tokens)


NEGATIVE_CONTROL_INSTANCES = [("equal", 3, 2, 2, 31), ("mixed", 3, 2, 2, 32), ("dirichlet", 2, 2, 3, 33),
                              ("sharp", 3, 1, 3, 34)]


@pytest.mark.parametrize("broken", [_mass_below_ties_reversed, _mass_below_by_q])
def test_inconsistent_ranking_is_detected(monkeypatch, broken):
    instances = [random_instance(v, l, k, seed=seed, kind=kind) for kind, v, l, k, seed in NEGATIVE_CONTROL_INSTANCES]
    verifier = get_verifier("gbv")
    assert max(exact_analysis(verifier, inst).max_law_error for inst in instances) < LOSSLESS_TOL
    # (the law's on-path masses: verify_gbv computes them from the rows by mass_below_of_rows)
    monkeypatch.setattr(gbv_module, "mass_below_of_rows", lambda p, q, tokens: broken(ranking.ranking_key(p, q), q, tokens))
    assert max(exact_analysis(verifier, inst).max_law_error for inst in instances) > 1e-6


# ---------------------------------------------------------------------------------------------- 8
def reference_gbv(draft_tokens, q, p, rng):
    """GBV as it was before the sort-free hot path: select, full rows of q_G (one sort per node), BV
    with full rows. The production verifier must have the same outcome law to 1e-12."""
    path = select_path(draft_tokens, q, p)
    tokens = draft_tokens[path]
    q_g = skewed_draft_law(tokens, q[path], p[path], draft_tokens.shape[0])
    p_path = p[path].to(torch.float64)
    block_len = tokens.shape[0]
    # BV's rule on the full rows, through the same decision core as production (the random source
    # records its calls, so the order of decisions must match too).
    ratios = (on_path_probs(p_path[:block_len], tokens) / on_path_probs(q_g, tokens)).tolist()

    def masses(rows, weights):
        w = torch.tensor(weights, dtype=torch.float64).unsqueeze(-1)
        return ranking.MassBounds.exactly((w * p_path[rows] - q_g[rows]).clamp_min(0.0).sum(-1).tolist())

    return VerifyResult(path, *block_verify_core(ratios, masses, lambda i, w: residual(p_path[i], q_g[i], w),
                                                 p_path[block_len], rng))


def _outcome_law(verifier, inputs):
    law = defaultdict(float)
    for result, prob in enumerate_branches(verifier, *inputs):
        law[(result.path, result.accepted_len, result.next_token)] += prob
    return law


def _same_outcomes(inputs, tol=1e-12):
    ours, ref = _outcome_law(verify_gbv, inputs), _outcome_law(reference_gbv, inputs)
    assert all(abs(ours.get(k, 0.0) - ref.get(k, 0.0)) < tol for k in set(ours) | set(ref))


@pytest.mark.parametrize("kind,vocab,block_len,num_paths,seed", BRUTE_FORCE_CASES)
def test_hot_path_matches_full_rows_on_exact_instances(kind, vocab, block_len, num_paths, seed):
    inst = _brute_force_instance(kind, vocab, block_len, num_paths, seed)
    seqs = [s for s in itertools.product(range(vocab), repeat=block_len) if inst.seq_prob(inst.draft, s) > 0]
    for paths in itertools.islice(itertools.product(seqs, repeat=num_paths), 50):
        _same_outcomes(tuple_inputs(inst, list(paths)))


class _Recorder:
    """Random source that accepts on its ``accept_at``-th call only (never, if -1) and samples the
    argmax, recording every probability and distribution it is asked about."""

    def __init__(self, accept_at: int) -> None:
        self.accept_at, self.calls, self.log = accept_at, 0, []

    def accept(self, prob: float) -> bool:
        self.log.append(float(prob))
        self.calls += 1
        return self.calls - 1 == self.accept_at

    def accept_within(self, low: float, high: float, exact) -> bool:
        prob, bounds = resolve_refinements(low, high, exact)
        assert all(lo - 1e-12 <= prob <= hi + 1e-12 for lo, hi in bounds)
        return self.accept(prob)

    def sample(self, dist: torch.Tensor) -> int:
        self.log.append(dist.double())
        return int(dist.argmax())


@pytest.mark.parametrize("vocab", [5000, 20000])
def test_hot_path_matches_full_rows_at_large_vocab(vocab):
    """Large rows go through the bucketed residual masses: every acceptance probability and
    correction distribution equals the full-row pipeline's to 1e-12 (too many branches to enumerate)."""
    gen = torch.Generator().manual_seed(vocab)
    num_paths, block_len = 3, 4
    q = torch.softmax(2 * torch.randn(num_paths, block_len, vocab, generator=gen, dtype=torch.float64), -1)
    p = torch.softmax(torch.log(q) + 0.3 * torch.randn(num_paths, block_len, vocab, generator=gen,
                                                       dtype=torch.float64), -1)
    p = torch.cat([p, torch.softmax(torch.randn(num_paths, 1, vocab, generator=gen, dtype=torch.float64), -1)], 1)
    q[1:, 0], p[1:, 0] = q[0, 0], p[0, 0]
    tokens = torch.stack([torch.multinomial(q[k], 1, generator=gen).squeeze(-1) for k in range(num_paths)])
    for accept_at in range(-1, block_len):
        ours, ref = _Recorder(accept_at), _Recorder(accept_at)
        assert verify_gbv(tokens, q, p, ours) == reference_gbv(tokens, q, p, ref)
        assert len(ours.log) == len(ref.log)
        for a, b in zip(ours.log, ref.log):
            if isinstance(a, float):
                assert abs(a - b) < 1e-12
            else:
                assert torch.allclose(a, b, atol=1e-12, rtol=0)


def _brute_positive_part(key, q64, p64, scale, law):
    rows = torch.arange(key.shape[0]).unsqueeze(-1)
    return (scale.unsqueeze(-1) * p64 - law.token_law(rows, ranking.mass_below_rows(key, q64), q64)).clamp_min(0).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_bucketed_positive_part_mass_is_exact(dtype):
    """``positive_part_mass`` against the sum over full rows, on rows built to stress the buckets:
    p = q (one bucket holds everything), heavy tails, zeros, ties, +inf keys, scale 0 and 1."""
    gen = torch.Generator().manual_seed(7)
    rows, vocab = 6, 6000
    q = _heavy_tailed(gen, (rows, vocab))
    p = _heavy_tailed(gen, (rows, vocab))
    p[0] = q[0]
    p[1] = torch.softmax(torch.log(q[1].clamp_min(1e-300)) + 0.05 * torch.randn(vocab, generator=gen,
                                                                                dtype=torch.float64), -1)
    q[2, :100] = 0.0
    q[2] /= q[2].sum()
    q, p = q.to(dtype).double(), p.to(dtype).double()
    key = ranking_key(p.to(dtype), q.to(dtype))
    scale = torch.tensor([1.0, 0.7, 0.3, 0.0, 1e-3, 0.9], dtype=torch.float64)
    laws = [gbv_module.SkewedLaw(torch.rand(rows, generator=gen, dtype=torch.float64),
                                 torch.zeros(rows, dtype=torch.float64), 4)]
    laws[0].u = 1 - laws[0].v
    laws[0].__post_init__()
    from gbv.verify.gbv_adaptive import AdaptiveLaw
    counts = torch.rand(rows, 4, generator=gen, dtype=torch.float64)
    laws.append(AdaptiveLaw(counts / counts.sum(-1, keepdim=True), torch.rand(rows, 4, generator=gen,
                                                                               dtype=torch.float64)))
    for law in laws:
        fast = ranking.positive_part_mass(key, q, p, scale, law)
        assert torch.allclose(fast, _brute_positive_part(key, q, p, scale, law), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------- 9
# The device form (verify_gbv_on_device: what verify_gbv runs on a GPU; one host read per call) is
# production code too: the same exact checks, run here on CPU tensors.
@pytest.mark.parametrize("vocab,block_len,num_paths,kind", [point for point in FAST if point[2] > 1])
def test_device_form_is_lossless(vocab, block_len, num_paths, kind):
    check_device_form(verify_gbv_on_device, verify_gbv, vocab, block_len, num_paths, kind)


@pytest.mark.parametrize("num_paths,expected", [(2, 131 / 81), (3, 1289 / 729)])
def test_device_form_spec_reference_values(num_paths, expected):
    inst = context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2, num_paths)
    assert abs(exact_analysis(verify_gbv_on_device, inst).expected_accepted - expected) < 1e-12


@pytest.mark.parametrize("kind,vocab,block_len,num_paths,seed", BRUTE_FORCE_CASES)
def test_device_form_has_the_host_forms_outcome_law(kind, vocab, block_len, num_paths, seed):
    """Per drafted tuple, the law of (path, accepted length, next token) equals the lazy host form's
    to 1e-12 (the two consume their randomness differently, so only laws can be compared)."""
    inst = _brute_force_instance(kind, vocab, block_len, num_paths, seed)
    check_same_outcome_laws(verify_gbv_on_device, verify_gbv, inst, tuples=50, tol=1e-12)


def _tree_inputs(gen: torch.Generator, num_paths: int, block_len: int, vocab: int, coarse: bool):
    """K random paths over a random tree of rows (a shared prefix shares its rows, as drafted paths
    do); ``coarse`` rows take few distinct values, so keys tie and some q are 0 at drafted tokens."""
    tokens = torch.randint(vocab, (num_paths, block_len), generator=gen)
    rows: dict[tuple[int, ...], torch.Tensor] = {}
    q = torch.zeros(num_paths, block_len, vocab)
    p = torch.zeros(num_paths, block_len + 1, vocab)
    for k in range(num_paths):
        for d in range(block_len + 1):
            ctx = tuple(tokens[k, :d].tolist())
            if ctx not in rows:
                pair = torch.rand(2, vocab, generator=gen)
                rows[ctx] = (pair * 3).round() / 3 if coarse else pair
            p[k, d] = rows[ctx][0]
            if d < block_len:
                q[k, d] = rows[ctx][1]
    return tokens, q, p


def test_select_path_on_device_equals_select_path():
    gen = torch.Generator().manual_seed(8)
    chosen = set()
    for trial in range(600):
        num_paths, block_len = 2 + trial % 6, 1 + trial % 4
        inputs = _tree_inputs(gen, num_paths, block_len, 3, coarse=trial % 2 == 1)
        expected = select_path(*inputs)
        assert int(select_path_on_device(*inputs)) == expected
        chosen.add(expected)
    assert len(chosen) > 3  # not always path 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("vocab", [1000, 5000])
def test_device_rows_equal_the_host_walks_rows(vocab, dtype):
    """The full rows of q_G from the device form (one sort per node, the walk as a cumulative
    product and sum in logarithms) against :func:`skewed_draft_law` (masked sums, the host walk), to
    1e-12 relative, on heavy-tailed rows (masses down to 1e-30, zeros, ties) and paths through
    tokens of tiny or zero q-mass, at L = 32, K = 16."""
    gen = torch.Generator().manual_seed(vocab)
    block_len, num_paths = 32, 16
    for drafted in (True, False):
        q = _heavy_tailed(gen, (block_len, vocab)).to(dtype)
        p = _heavy_tailed(gen, (block_len + 1, vocab)).to(dtype)
        if drafted:
            tokens = torch.multinomial(q.double(), 1, generator=gen).squeeze(-1)
        else:
            tokens = torch.randint(vocab, (block_len,), generator=gen)
            tokens[::4] = 4
        host = skewed_draft_law(tokens, q, p, num_paths)
        device = skewed_law_rows_on_device(tokens, q, p, num_paths)
        assert device.dtype == torch.float64 and torch.all(torch.isfinite(device))
        assert torch.all((device - host).abs() <= 1e-12 * host.abs())


_REAL_WALK = gbv_module.path_walk_on_device


def _walk_without_rank_mass(below_on, q_on):
    """Broken: the walk forgets the mass ranked below the selected token (u stays 0)."""
    return _REAL_WALK(torch.zeros_like(below_on), q_on)


def _selection_always_first(draft_tokens, q, p):
    """Broken: always path 0 (BV on path 0, but told the law of the greedy selection)."""
    return torch.zeros((), dtype=torch.long)


def _rows_ranked_by_q(key, q64):
    """Broken: the law ranks by q alone (the selection still by p / q)."""
    return ranking.mass_below_rows_sorted(q64, q64)


@pytest.mark.parametrize("name,broken", [("path_walk_on_device", _walk_without_rank_mass),
                                         ("select_path_on_device", _selection_always_first),
                                         ("mass_below_rows_sorted", _rows_ranked_by_q)])
def test_device_form_negative_controls(monkeypatch, name, broken):
    instances = [random_instance(v, l, k, seed=seed, kind=kind) for kind, v, l, k, seed in NEGATIVE_CONTROL_INSTANCES]
    assert max(exact_analysis(verify_gbv_on_device, inst).max_law_error for inst in instances) < LOSSLESS_TOL
    monkeypatch.setattr(gbv_module, name, broken)
    assert max(exact_analysis(verify_gbv_on_device, inst).max_law_error for inst in instances) > 1e-6


# ---------------------------------------------------------------------------------------------- 10
# The residual masses as bounds (ranking.residual_bounds_ranked): the settled buckets exact, the
# unsettled ones bounded, a node's exact mass sorted only when a stop coin falls between the bounds.
BUCKETED_INSTANCES = [(3, 2, 2, "dirichlet", 7), (3, 2, 3, "mixed", 7), (2, 3, 3, "truncated", 7),
                      (4, 2, 2, "sharp", 7), (3, 3, 2, "equal", 8)]


@pytest.mark.parametrize("vocab,block_len,num_paths,kind,seed", BUCKETED_INSTANCES)
def test_bucketed_code_paths_are_lossless(monkeypatch, vocab, block_len, num_paths, kind, seed):
    """The large-vocabulary code (bucketed residual masses as bounds) forced on tiny instances and
    proven lossless by exact enumeration; the enumerator also checks, on every branch, that the
    bounds contain the exact stop probability."""
    coarse_buckets(monkeypatch)
    inst = random_instance(vocab, block_len, num_paths, seed, kind)
    assert exact_analysis(verify_gbv, inst).max_law_error < LOSSLESS_TOL


@pytest.mark.parametrize("broken", ["upper", "lower", "cheap"])
def test_bounds_that_miss_the_exact_mass_are_caught(monkeypatch, broken):
    """Negative control: one bound collapsed onto the other (the unsettled buckets' upper bound
    forgotten, or their lower bound raised to the upper one), or the cheap upper bound ``w sum p``
    halved. Equal bounds are taken as the exact mass, so the law goes wrong, or the enumerator sees
    bounds that miss the exact probability: either way the check fails."""
    coarse_buckets(monkeypatch)
    if broken == "cheap":
        monkeypatch.setattr(ranking, "MASS_MARGIN", -0.5)
    real_split = ranking._split_buckets

    def split_with_one_bound(*args):
        split = real_split(*args)
        if split is not None and broken != "cheap":
            if broken == "upper":
                split.high = split.low.copy()
            else:
                split.low = split.high.copy()
        return split

    monkeypatch.setattr(ranking, "_split_buckets", split_with_one_bound)
    errors = []
    for v, l, k, kind, seed in BUCKETED_INSTANCES:
        try:
            errors.append(exact_analysis(verify_gbv, random_instance(v, l, k, seed, kind)).max_law_error)
        except AssertionError as exc:  # the enumerator saw bounds that miss the exact probability
            assert "bounds" in str(exc)
            errors.append(math.inf)
    assert max(errors) > 1e-6


@pytest.mark.parametrize("vocab", [5000, 20000])
def test_residual_bounds_contain_the_exact_masses(vocab):
    """Bounds and on-demand exact masses against the full-row sums, at real vocabulary sizes."""
    gen = torch.Generator().manual_seed(vocab + 1)
    rows = 6
    q = _heavy_tailed(gen, (rows, vocab))
    p = torch.softmax(torch.log(q.clamp_min(1e-300)) + 0.3 * torch.randn(rows, vocab, generator=gen,
                                                                         dtype=torch.float64), -1)
    p[0] = q[0]
    key = ranking_key(p.float(), q.float())
    q, p = q.float(), p.float()
    law = gbv_module.SkewedLaw(torch.rand(rows, generator=gen, dtype=torch.float64), torch.zeros(rows, dtype=torch.float64), 4)
    law.u = 1 - law.v
    law.__post_init__()
    nodes, weights = [1, 2, 3, 5], [0.9, 0.5, 1e-3, 0.99]
    bounds = ranking.residual_bounds_ranked(key, q, p, nodes, weights, law)
    exact = ranking.residual_masses_ranked(key, q, p, nodes, weights, law)
    brute = _brute_positive_part(key[nodes], q[nodes].double(), p[nodes].double(),
                                 torch.tensor(weights, dtype=torch.float64), ranking.RowsOf(law, torch.tensor(nodes)))
    for j in range(len(nodes)):
        low, high = bounds.tighter(j)  # the key buckets of node j: inside the cheap bounds
        assert bounds.low[j] - 1e-12 <= low <= exact[j] <= high <= bounds.high[j] + 1e-12
        assert bounds.high[j] == pytest.approx(weights[j] * float(p[nodes[j]].double().sum()), rel=1e-8)
        assert bounds.exact(j) == pytest.approx(float(brute[j]), abs=1e-12)
