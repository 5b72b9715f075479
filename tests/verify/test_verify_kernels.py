"""The compiled helpers of the verifiers' host forms (gbv/verify/_verify_kernels.c) against the numpy
code they replace: ``occupied_bucket_masses`` and ``mass_below_among`` bit for bit (the same sums in
the same order), ``node_weights`` to rounding, on rows with ties, zeros, p = q, q = 0 < p (infinite
keys), -0.0 keys and sharp temperatures. The weights' own correctness (the smallest maximiser of F)
is tests/verify/test_gbv_adaptive.py's brute force, run on every search including the compiled one.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from exact_checks import LOSSLESS_TOL, embedded_law_gap
from gbv.theory import exact_analysis, random_instance
from gbv.theory.instance import TinyInstance
from gbv.verify import common, gbv_adaptive, get_verifier, ranking
from gbv.verify import block as block_module
from gbv.verify import gbv as gbv_module

KERNELS = common.compiled_kernels
pytestmark = pytest.mark.skipif(KERNELS is None, reason="gbv.verify._verify_kernels is not built")


def _rows(vocab: int, seed: int, temperature: float, kind: str):
    """(V,) float64 p and q (float32 values, as the engine's rows), float32 keys, exact float64 W."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(vocab, generator=gen, dtype=torch.float64)
    q = torch.softmax(logits / temperature, -1)
    p = torch.softmax((logits + 0.5 * torch.randn(vocab, generator=gen, dtype=torch.float64)) / temperature, -1)
    if kind == "ties":  # p = q on a third of the tokens, and repeated keys
        p[: vocab // 3] = q[: vocab // 3]
        p[vocab // 3: vocab // 2] = 2.0 * q[vocab // 3: vocab // 2]
    elif kind == "zeros":  # top-k-like rows: q = 0 < p (key +inf), p = q = 0 (key -1), p = 0 < q (key 0)
        q[::3] = 0.0
        p[2::5] = 0.0
        p[::7] = 0.0
    q, p = (row / row.sum() for row in (q, p))
    q, p = (row.float().double() for row in (q, p))
    key = ranking.ranking_key(p.float(), q.float())
    below = ranking.mass_below_rows(key[None], q[None])[0]
    return p.numpy(), q.numpy(), key.numpy(), below.numpy()


CASES = [(vocab, seed, temperature, kind) for vocab in (2, 3, 7, 60, 700, 4096) for seed in (0, 1)
         for temperature in (0.2, 1.0) for kind in ("plain", "ties", "zeros")]


def _numpy(monkeypatch, fn, *args):
    with monkeypatch.context() as patch:
        patch.setattr(common, "compiled_kernels", None)
        return fn(*args)


@pytest.mark.parametrize("vocab,seed,temperature,kind", CASES)
def test_compiled_helpers_equal_the_numpy_code(monkeypatch, vocab, seed, temperature, kind):
    p, q, key, below = _rows(vocab, seed, temperature, kind)
    for num_paths in (1, 2, 4):
        compiled = gbv_adaptive.node_weights(p, q, below, num_paths)
        reference = _numpy(monkeypatch, gbv_adaptive.node_weights, p, q, below, num_paths)
        assert len(compiled) == len(reference) and compiled[:2] == [0.0, 0.0]
        assert compiled == pytest.approx(reference, abs=1e-12), num_paths
    for compiled, reference in zip(ranking.occupied_bucket_masses(key, q, p),
                                   _numpy(monkeypatch, ranking.occupied_bucket_masses, key, q, p)):
        assert compiled.dtype == reference.dtype and np.array_equal(compiled, reference)
    among = (q > 0).nonzero()[0]
    assert np.array_equal(ranking.mass_below_among(key[among], q[among]),
                          _numpy(monkeypatch, ranking.mass_below_among, key[among], q[among]))


def test_mass_below_among_orders_ties_and_signed_zeros_as_numpy():
    """Equal keys rank by the smaller id first; -0.0 equals +0.0; -1 (p = q = 0) and +inf sort as floats;
    a wrong tie order would move mass between tied tokens and fail the equality."""
    key = np.array([0.5, -0.0, 0.5, np.inf, 0.0, -1.0, 0.5, np.inf, 2.0], dtype=np.float32)
    q = np.arange(1, 10, dtype=np.float64) / 45.0
    ours = ranking.mass_below_among(key, q)
    # Worst first: -1 (5), the zeros by larger id first (4, 1), the 0.5s (6, 2, 0), 2.0 (8), inf (7, 3).
    worst_first = [5, 4, 1, 6, 2, 0, 8, 7, 3]
    expected = np.empty(9)
    expected[worst_first] = np.concatenate([[0.0], np.cumsum(q[worst_first])[:-1]])
    assert np.array_equal(ours, expected)


def test_node_weights_of_an_equal_draft_and_bad_rows():
    q = np.array([0.5, 0.3, 0.2])
    below = np.array([0.5, 0.2, 0.0])
    assert KERNELS.node_weights(q.copy(), q, below, 4) == [0.0] * 5
    with pytest.raises(ValueError, match="float64 and of one length"):
        KERNELS.node_weights(q, q[:2], below, 3)
    with pytest.raises(ValueError, match="float32"):
        KERNELS.mass_below_among(q, q, np.empty(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_draw_is_torch_randoms_numpy_rule(monkeypatch, dtype):
    """TorchRandom.sample through draw_row gives the index of its numpy rule (a float64 cumsum and a
    search of u * total * BELOW_ONE) for the same uniforms: rows of one token, with zeros (a zero run
    at the end: the last index is the fallback), sharp and flat rows."""
    gen = torch.Generator().manual_seed(5)
    rows = [torch.ones(1), torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])]
    for vocab in (2, 17, 4096):
        rows.append(torch.rand(vocab, generator=gen) ** 8)
        sparse = torch.rand(vocab, generator=gen)
        sparse[torch.rand(vocab, generator=gen) < 0.8] = 0.0
        sparse[0] = 1.0
        rows.append(sparse)
    for row in rows:
        row = (row / row.sum()).to(dtype)
        compiled, reference = (common.TorchRandom(torch.Generator().manual_seed(3)) for _ in range(2))
        ours = [compiled.sample(row) for _ in range(200)]
        with monkeypatch.context() as patch:
            patch.setattr(common, "compiled_kernels", None)
            theirs = [reference.sample(row) for _ in range(200)]
        assert ours == theirs
    with pytest.raises(ValueError, match="non-empty"):
        KERNELS.draw_row(np.empty(0), True, 0.5, 1.0)


def test_mass_below_at_is_the_numpy_masked_sum(monkeypatch):
    """mass_below_array's compiled form (float32 keys, q float64 or float32) against its numpy form,
    to rounding (four interleaved running sums against numpy's dot product), on rows with tied keys
    (the tie order by index decides what is below) and on every position of a token in the row."""
    gen = np.random.default_rng(7)
    for vocab in (1, 2, 9, 700, 4096):
        rows = 6
        key = (gen.random((rows, vocab)) * 3).astype(np.float32)
        key[::2] = np.round(key[::2], 1)  # ties
        q = gen.random((rows, vocab))
        q /= q.sum(-1, keepdims=True)
        tokens = [0, vocab - 1, vocab // 2, int(gen.integers(vocab)), int(gen.integers(vocab)), vocab // 3]
        for q_rows in (q, q.astype(np.float32)):
            ours = ranking.mass_below_array(key, q_rows, tokens)
            with monkeypatch.context() as patch:
                patch.setattr(common, "compiled_kernels", None)
                theirs = ranking.mass_below_array(key, q_rows.astype(np.float64), tokens)
            assert np.allclose(ours, theirs, rtol=1e-12, atol=1e-15), (vocab, q_rows.dtype)
    with pytest.raises(IndexError, match="outside the row"):
        KERNELS.mass_below_at(key, q, True, np.array([0, 0, 0, 0, 0, vocab], dtype=np.int64), np.empty(6), 6, vocab)


# ------------------------------------------------- the selection, keyed masses, bucket split, residual row
def test_compiled_selection_is_select_path_host():
    """gbv.select_path through the compiled selection against select_path_host: paths that share
    prefixes (ties are decided further down), equal keys (p = q rows: ties by the smaller token id),
    identical paths (the smallest index), q = 0 < p is not drafted, K up to 6."""
    gen = torch.Generator().manual_seed(11)
    checked = 0
    for num_paths in (2, 3, 6):
        for block_len in (1, 3, 8):
            for vocab in (3, 50):
                for equal in (False, True):
                    tokens = torch.randint(vocab, (num_paths, block_len), generator=gen)
                    tokens[1:, : block_len // 2] = tokens[0, : block_len // 2]  # shared prefixes
                    if num_paths > 2:
                        tokens[2] = tokens[1]
                    q = torch.softmax(torch.randn(num_paths, block_len, vocab, generator=gen), -1)
                    p = q.clone() if equal else torch.softmax(torch.randn(num_paths, block_len + 1, vocab,
                                                                          generator=gen), -1)
                    if equal:
                        p = torch.cat([p, q[:, :1]], 1)
                    host = gbv_module.select_path_host(tokens.numpy(), gbv_module._on_path(q, tokens, tokens.numpy()),
                                                       gbv_module._on_path(p, tokens, tokens.numpy()))
                    assert gbv_module.select_path(tokens, q, p) == host, (num_paths, block_len, vocab, equal)
                    checked += 1
    assert checked == 36
    with pytest.raises(IndexError, match="outside the vocabulary"):
        KERNELS.select_path(np.full((2, 1), 5, dtype=np.int64), np.zeros((2, 1, 3), np.float32),
                            np.zeros((2, 2, 3), np.float32), 2, 1, 2, 3)


@pytest.mark.parametrize("vocab", [1, 9, 700, 4096])
def test_keyed_masses_are_the_masked_sums_of_the_keys(monkeypatch, vocab):
    """mass_below_of_rows computes each key where it compares it: the same sums as mass_below_at on the
    keys of ranking_key (bit for bit), and numpy's masked sums to rounding; rows with q = 0 < p, p = q = 0
    and ties."""
    gen = np.random.default_rng(vocab)
    rows = 5
    q = gen.random((rows, vocab)).astype(np.float32)
    p = gen.random((rows, vocab)).astype(np.float32)
    q[:, ::4] = 0.0
    p[:, ::6] = 0.0
    p[::2, 1::3] = q[::2, 1::3]  # ties of key 1
    q[:, 0], p[:, 0] = 0.5, 0.25  # the drafted tokens below have q > 0
    tokens = [0, vocab - 1 if q[1, vocab - 1] > 0 else 0, vocab // 2 if q[2, vocab // 2] > 0 else 0, 0, 0]
    ours = ranking.mass_below_of_rows(p, q, tokens)
    key = ranking.ranking_key(p, q)
    assert np.array_equal(ours, ranking.mass_below_array(key, q, tokens))
    theirs = _numpy(monkeypatch, ranking.mass_below_of_rows, p, q, tokens)
    assert np.allclose(ours, theirs, rtol=1e-12, atol=1e-15)


def _laws(block_len: int, num_paths: int, seed: int) -> list:
    """A GBV law and a gbv-adaptive law over ``block_len`` nodes (random walk values, counts, weights)."""
    gen = np.random.default_rng(seed)
    v = gen.random(block_len)
    skewed = gbv_module.SkewedLaw(v, 1.0 - v, num_paths)
    counts = gen.random((block_len, num_paths))
    counts /= counts.sum(-1, keepdims=True)
    lams = gen.random((block_len, num_paths))
    lams[:, 0] = 0.0
    lams[0, 1:] = 1.0  # weight 1 (GBV's) at one node
    return [skewed, gbv_adaptive.AdaptiveLaw(counts, lams)]


@pytest.mark.parametrize("temperature,kind", [(0.2, "plain"), (1.0, "plain"), (1.0, "ties"), (0.2, "zeros")])
@pytest.mark.parametrize("num_paths", [2, 3, 4])
def test_compiled_bucket_split_is_the_numpy_split(monkeypatch, temperature, kind, num_paths):
    """residual_bounds_ranked's compiled split (one call per node) gives the numpy split's bits: the
    tighter bounds and the exact mass of every node, for both laws, at scales that settle every bucket,
    some, or none, on rows at the bucketed vocabulary."""
    block_len, vocab = 4, 4096
    rows = [_rows(vocab, 10 * node + num_paths, temperature, kind) for node in range(block_len + 1)]
    p = np.stack([row[0] for row in rows]).astype(np.float32)
    q = np.stack([row[1] for row in rows[:block_len]]).astype(np.float32)
    nodes, weights = [1, 2, 3], [1.0, 0.37, 1e-4]
    for law in _laws(block_len, num_paths, num_paths):
        for key in (None, ranking.ranking_key(p[:block_len], q)):
            results = []
            for kernels in (KERNELS, None):
                with monkeypatch.context() as patch:
                    patch.setattr(common, "compiled_kernels", kernels)
                    bounds = ranking.residual_bounds_ranked(key, q, p, nodes, weights, law)
                    results.append([(bounds.tighter(j), bounds.exact(j)) for j in range(len(nodes))])
            assert results[0] == results[1], type(law).__name__
            for (low, high), exact in results[0]:
                assert low <= exact <= high


def test_split_row_with_float64_rows_and_bad_input():
    """The split's float64 rows (the same values as float32 rows converted) give the same bits, and
    a law with the wrong number of constants is refused."""
    p, q, key, _ = _rows(4096, 3, 1.0, "ties")
    key_lo, key_hi = ranking._bucket_key_bounds()
    law = np.array([0.6, 0.4, 1.7])
    as32 = KERNELS.split_row(key, q.astype(np.float32), p.astype(np.float32), False, 0.8, 0, 3, law, key_lo, key_hi,
                             True)
    as64 = KERNELS.split_row(key, q, p, True, 0.8, 0, 3, law, key_lo, key_hi, True)
    assert as32 == as64
    with pytest.raises(ValueError, match="kind 0: 3 constants"):
        KERNELS.split_row(key, q, p, True, 0.8, 0, 3, law[:2], key_lo, key_hi, True)


@pytest.mark.parametrize("vocab", [2, 7, 700, 4096])
def test_compiled_residual_row_is_the_numpy_residual_row(monkeypatch, vocab):
    """residual_row's compiled form against its numpy form: the same support, the same distribution to
    rounding (the others' mass and the total are summed in another order), for both laws, weights from
    1 down to 0 (no candidate: the fallback to p), sharp and flat rows with ties and zeros."""
    for temperature, kind in ((0.2, "plain"), (1.0, "ties"), (1.0, "zeros")):
        p64, q64, key, _ = _rows(vocab, vocab, temperature, kind)
        p, q = p64.astype(np.float32), q64.astype(np.float32)
        for law in _laws(2, 3, vocab):
            for w in (1.0, 0.5, 1e-3, 0.0):
                for q_rows in (q, q64):
                    ours = ranking.residual_row(key, q_rows, p, w, law, 1).numpy()
                    theirs = _numpy(monkeypatch, ranking.residual_row, key, q_rows, p, w, law, 1).numpy()
                    assert np.array_equal(ours > 0, theirs > 0), (temperature, kind, w)
                    assert np.allclose(ours, theirs, rtol=1e-10, atol=1e-15), (temperature, kind, w)


def _dyadic(inst, denominator: int = 64):
    """``inst`` with every row rounded to multiples of 1/denominator (the rounding put on the largest
    entry): float32 holds such rows exactly and they sum to exactly 1, so the enumerator can replay a
    verifier on float32 inputs, which is what takes the compiled paths."""
    def rounded(row):
        out = np.floor(row * denominator) / denominator
        out[int(np.argmax(row))] += 1.0 - out.sum()
        return out

    return TinyInstance(inst.vocab, inst.block_len, inst.num_paths, {c: rounded(r) for c, r in inst.target.items()},
                        {c: rounded(r) for c, r in inst.draft.items()})


def _float32_law_gap(verifier, inst, seed: int) -> float:
    """The largest outcome-law difference, over six random tuples of three paths drawn from ``inst``'s
    draft, between the float64 tiny instance and its float32 embedding at V = 8,192."""
    gen = np.random.default_rng(seed)
    seqs = [s for s in itertools.product(range(inst.vocab), repeat=inst.block_len) if inst.seq_prob(inst.draft, s) > 0]
    return max(embedded_law_gap(verifier, inst, [seqs[i] for i in gen.integers(len(seqs), size=3)], 8192,
                                [17, 4000, 8191], torch.float32) for _ in range(6))


class _CountingKernels:
    """The compiled module with a count of the calls of each function (so a test sees it was used)."""

    def __init__(self, module):
        self.module, self.calls = module, {}

    def __getattr__(self, name):
        function = getattr(self.module, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return function(*args)
        return counted


@pytest.mark.parametrize("method", ["gbv", "gbv-adaptive", "gbv-adaptive-per-node"])
@pytest.mark.parametrize("seed", [0, 1])
def test_float32_inputs_through_the_compiled_paths_have_the_exact_law(monkeypatch, method, seed):
    """Exact enumeration of the compiled paths. The float64 tiny instance runs the numpy code (its keys
    are float64), whose law the losslessness grid proves. Its float32 copy embedded at V = 8192 (the
    bucketed code) runs the compiled selection, keyed masses, bucket split and residual row, and must
    give the same outcome law to 1e-12 on every tuple of drafted paths tried (K = 3; L = 3, so that
    BV's stop coins ask for the bucket split). gbv-adaptive selects in one compiled call
    (adaptive_select), or per node (adaptive_node, adaptive_step) with ``FUSED_SELECTION`` off."""
    if method == "gbv-adaptive-per-node":
        monkeypatch.setattr(gbv_adaptive, "FUSED_SELECTION", False)
    verifier = get_verifier(method.removesuffix("-per-node"))
    inst = _dyadic(random_instance(3, 3, 3, 40 + seed, "mixed"))
    assert exact_analysis(verifier, inst.with_paths(2)).max_law_error < LOSSLESS_TOL  # (3^9 tuples at K = 3: slow)
    counting = _CountingKernels(KERNELS)
    monkeypatch.setattr(common, "compiled_kernels", counting)
    assert _float32_law_gap(verifier, inst, seed) < 1e-12
    used = {"gbv": ("select_path", "mass_below_keyed"), "gbv-adaptive": ("adaptive_select",),
            "gbv-adaptive-per-node": ("adaptive_node", "adaptive_step")}[method]
    for name in (*used, "split_row", "residual_dist"):
        assert counting.calls.get(name, 0) > 0, (name, counting.calls)
    if method == "gbv-adaptive":
        assert "adaptive_node" not in counting.calls


def test_the_float32_exact_check_catches_a_broken_compiled_law(monkeypatch):
    """Negative control of the test above: a residual row and a bucket split that evaluate the law with
    one path too many (K + 1 in the power sums) change the outcome law of some tuple of paths."""
    class Broken(_CountingKernels):
        def __getattr__(self, name):
            function = getattr(self.module, name)
            if name == "residual_dist":  # (key, q, q64, p, w, margin, kind, K, constants, out)
                return lambda *a: function(*a[:7], a[7] + 1, *a[8:])
            if name == "split_row":  # (key, q, p, rows64, scale, kind, K, constants, ...)
                return lambda *a: function(*a[:6], a[6] + 1, *a[7:])
            return function

    monkeypatch.setattr(common, "compiled_kernels", Broken(KERNELS))
    assert _float32_law_gap(get_verifier("gbv"), _dyadic(random_instance(3, 3, 3, 40, "mixed")), 0) > 1e-6


def test_the_float32_exact_check_catches_a_broken_fused_selection(monkeypatch):
    """Negative control for gbv-adaptive's fused selection in the exact float32 law test: a selection
    whose coin takes the best-ranked token with probability 1 - lam (what the law it reports assumes
    is lam) changes the outcome law of some tuple of paths."""
    class Broken(_CountingKernels):
        def __getattr__(self, name):
            function = getattr(self.module, name)
            if name == "adaptive_select":  # (q, p, tokens, key_rows, K, L, V, cut, accept)
                return lambda *a: function(*a[:8], lambda prob: a[8](1.0 - prob))
            return function

    monkeypatch.setattr(common, "compiled_kernels", Broken(KERNELS))
    inst = _dyadic(random_instance(3, 3, 3, 40, "mixed"))
    assert max(_float32_law_gap(get_verifier("gbv-adaptive"), inst, seed) for seed in (0, 1)) > 1e-6


def _four_sums_reference(key: np.ndarray, q: np.ndarray, y: int) -> float:
    """The masked sum in pure Python: token x into running sum x mod 4, then (s0 + s1) + (s2 + s3)."""
    sums = [0.0] * 4
    k_y = float(key[y])
    for x, (k, q_x) in enumerate(zip(key.tolist(), q.astype(np.float64).tolist())):
        if k < k_y or (k == k_y and x > y):
            sums[x & 3] += q_x
    return (sums[0] + sums[1]) + (sums[2] + sums[3])


@pytest.mark.parametrize("vocab", [1, 5, 8, 13, 4096, 4099])
def test_simd_and_scalar_masked_sums_are_the_four_running_sums(vocab):
    """mass_below_at and mass_below_keyed in their AVX2 and scalar forms give the bits of the four
    running sums written out in Python: vocabularies with and without a tail past the last 8 tokens,
    tied keys, q = 0 < p and p = q = 0 tokens, the token at the start, the end and inside a tie."""
    gen = np.random.default_rng(vocab)
    rows = 4
    q = gen.random((rows, vocab)).astype(np.float32)
    p = gen.random((rows, vocab)).astype(np.float32)
    q[:, 1::5] = 0.0
    p[:, 2::7] = 0.0
    p[:, ::3] = np.round(q[:, ::3], 2)
    q[:, ::3] = np.round(q[:, ::3], 2)  # ties of key 1
    q[:, 0] = p[:, 0] = 0.25
    tokens = np.array([0, vocab - 1, vocab // 2, (vocab // 3) * 3], dtype=np.int64)
    q[np.arange(rows), tokens] = 0.5  # drafted tokens have q > 0
    key = ranking.ranking_key(p, q)
    expected = [_four_sums_reference(key[r], q[r], int(tokens[r])) for r in range(rows)]
    try:
        for simd in (True, False):
            KERNELS.set_simd(simd)
            for q_rows in (q, q.astype(np.float64)):
                out = np.empty(rows)
                KERNELS.mass_below_at(key, q_rows, q_rows.dtype == np.float64, tokens, out, rows, vocab)
                assert out.tolist() == expected, (simd, q_rows.dtype)
            out = np.empty(rows)
            KERNELS.mass_below_keyed(p, q, tokens, out, rows, vocab)
            assert out.tolist() == expected, simd
    finally:
        KERNELS.set_simd(True)


@pytest.mark.parametrize("num_paths", [1, 2, 3, 5, 8])
def test_adaptive_step_is_the_python_node_update(num_paths):
    """adaptive_step (gbv-adaptive's node after its coin) gives the bits of the Python code it stands
    for: the chosen token's W by the masked sum, q_A(s) = q_s sum_n a(n) (lam_n S_n + 1 - lam_n) and
    update_counts; counts with zeros, weights 0, 1 and between, sharp and flat rows, q float32 and
    float64."""
    gen = np.random.default_rng(num_paths)
    for temperature, kind in ((0.2, "plain"), (1.0, "ties"), (1.0, "zeros")):
        p64, q64, key, _ = _rows(4096, num_paths, temperature, kind)
        p, q = p64.astype(np.float32), q64.astype(np.float32)
        for _ in range(5):
            counts = gen.random(num_paths + 1)
            counts[0] = 0.0
            counts[gen.random(num_paths + 1) < 0.3] = 0.0
            counts = (counts / counts.sum() if counts.sum() > 0 else counts).tolist()
            lams = [0.0, 0.0] + gen.choice([0.0, 1.0, 0.37, 0.999], size=num_paths - 1).tolist()
            chosen = int(gen.choice(np.flatnonzero(q > 0)))
            for q_row in (q, q.astype(np.float64)):
                below_s = float(ranking.mass_below_array(key[None], q_row[None], [chosen])[0])
                q_s, p_s = float(q_row[chosen]), float(p[chosen])
                ratio = sum(counts[n] * (lams[n] * ranking.power_sum(below_s + q_s, below_s, n) + (1.0 - lams[n]))
                            for n in range(1, num_paths + 1) if counts[n] > 0.0)
                expected = (below_s, q_s, p_s, q_s * ratio,
                            gbv_adaptive.update_counts(counts, lams, q_s, below_s))
                got = KERNELS.adaptive_step(key, q_row, q_row.dtype == np.float64, p, chosen, counts, lams)
                assert got == expected, (temperature, kind, counts, lams)
    with pytest.raises(ValueError, match="K \\+ 1 counts"):
        KERNELS.adaptive_step(key, q, False, p, 0, [0.0, 1.0], [0.0, 0.0, 0.0])


@pytest.mark.parametrize("vocab", [4096, 4099])
@pytest.mark.parametrize("temperature,kind", [(0.2, "plain"), (1.0, "plain"), (1.0, "ties"), (0.2, "zeros")])
def test_adaptive_node_is_the_keys_and_host_node_weights(temperature, kind, vocab):
    """adaptive_node writes ranking_key's float32 keys and returns host_node_weights' weights (the
    sharp cut and the flat buckets both: the same inputs to the same search), for K = 1 to 6, with its
    keys and support count in AVX2 (eight tokens a step, a tail past them at V = 4099) and scalar."""
    p64, q64, _, _ = _rows(vocab, 5, temperature, kind)
    p, q = p64.astype(np.float32), q64.astype(np.float32)
    key = ranking.ranking_key(p, q)
    try:
        for simd in (True, False):
            KERNELS.set_simd(simd)
            for num_paths in (1, 2, 3, 6):
                key_out = np.empty_like(key)
                lams = KERNELS.adaptive_node(p, q, key_out, num_paths, gbv_adaptive._WEIGHT_MASS_CUT / vocab)
                assert np.array_equal(key_out.view(np.int32), key.view(np.int32))
                assert lams == gbv_adaptive.host_node_weights(p.astype(np.float64), q.astype(np.float64), key,
                                                              num_paths)
    finally:
        KERNELS.set_simd(True)


def test_positive_part_is_the_numpy_row(monkeypatch):
    """BV's and token-level sampling's residual row (w p - q)+: the compiled form gives numpy's row
    (the same values) and its sum to rounding, for q float32 and float64, w = 1, below 1 and 0."""
    for temperature, kind in ((0.2, "plain"), (1.0, "ties"), (1.0, "zeros")):
        p64, q64, _, _ = _rows(4099, 9, temperature, kind)
        p = p64.astype(np.float32)
        for q in (q64.astype(np.float32), q64):
            for w in (1.0, 0.61, 0.0):
                row, total = block_module.positive_part_and_sum(p, q, w)
                ref_row, ref_total = _numpy(monkeypatch, block_module.positive_part_and_sum, p, q, w)
                assert np.array_equal(row, ref_row)
                assert total == pytest.approx(ref_total, rel=1e-13, abs=1e-300)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_spectr_root_is_the_numpy_root(monkeypatch, dtype):
    """SpecTr's root search, compiled, against its numpy code: the same rho to rounding (the sums run
    in order, numpy's pairwise), on sharp and flat rows with ties, zeros and one-hot rows, k = 1 to 6;
    and the inequality holds at it (the tests of _smallest_rho in test_spectr.py run the compiled form,
    since it is installed)."""
    from gbv.verify import spectr

    rows = []
    for temperature, kind in ((0.2, "plain"), (1.0, "plain"), (1.0, "ties"), (0.2, "zeros")):
        p, q, _, _ = _rows(700, 3, temperature, kind)
        rows.append((p, q))
    hot = np.zeros(700)
    hot[5] = 1.0
    rows += [(hot, rows[1][1]), (rows[1][0], hot), (rows[1][0], rows[1][0].copy())]
    for p, q in rows:
        p, q = p.astype(dtype), q.astype(dtype)
        for k in range(1, 7):
            ours = spectr._smallest_rho(p, q, k)
            theirs = _numpy(monkeypatch, spectr._smallest_rho, p, q, k)
            assert ours == pytest.approx(theirs, rel=1e-10), k
            p64, q64 = p.astype(np.float64), q.astype(np.float64)
            beta = np.minimum(q64, p64 / ours).sum()
            assert ours * beta >= 1.0 - (1.0 - beta) ** k - 1e-12


def _path_instance(vocab: int, block_len: int, seed: int, temperature: float, kind: str):
    """One path as the engine hands it to BV or token-level sampling: (L,) long tokens drawn from the
    float32 q rows (L, V) and the float32 p rows (L + 1, V). ``kind``: "plain"; "equal" (p = q on
    the path: every weight 1); "zeros" (top-k-like rows with zeros in p and q, and drafted tokens
    where p = 0: weights of 0); "onehot" (a greedy target: p one-hot)."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(block_len + 1, vocab, generator=gen, dtype=torch.float64)
    q = torch.softmax(logits[:block_len] / temperature, -1)
    p = torch.softmax((logits + 0.7 * torch.randn(block_len + 1, vocab, generator=gen, dtype=torch.float64))
                      / temperature, -1)
    if kind == "equal":
        p[:block_len] = q
    elif kind == "zeros":
        q[:, 1::3] = 0.0
        p[:, ::4] = 0.0
    elif kind == "onehot":
        p = torch.nn.functional.one_hot(p.argmax(-1), vocab).double()
    q, p = (rows / rows.sum(-1, keepdim=True) for rows in (q, p))
    q, p = q.float().contiguous(), p.float().contiguous()
    tokens = torch.multinomial(q.double(), 1, generator=gen)[:, 0]
    if kind == "zeros":  # drafted tokens the target rules out (p = 0 < q)
        tokens[::2] = torch.tensor([int((q[i] > 0).nonzero()[0]) for i in range(0, block_len, 2)])
        p[::2][torch.arange(tokens[::2].numel()), tokens[::2]] = 0.0
    return tokens, q, p


def _without_single_path():
    """The compiled helpers without ``single_path``: the numpy forms of BV and token-level sampling
    with every other helper as in production (positive_part, draw_row: the same sums)."""
    import types
    return types.SimpleNamespace(**{name: getattr(KERNELS, name) for name in dir(KERNELS)
                                    if not name.startswith("_") and name != "single_path"})


def _single_path_outcomes(monkeypatch, form, tokens, q, p, seeds, numpy_form: bool):
    """(accepted_len, next_token, the random source's next uniform) of ``form`` per seed."""
    outcomes = []
    with monkeypatch.context() as patch:
        if numpy_form:
            patch.setattr(common, "compiled_kernels", _without_single_path())
        for seed in seeds:
            rng = common.TorchRandom(torch.Generator().manual_seed(seed))
            outcomes.append((*form(tokens, q, p, rng), rng.uniform()))
    return outcomes


SINGLE_PATH_CASES = [(vocab, block_len, temperature, kind) for vocab, block_len in ((2, 1), (7, 3), (700, 4), (4096, 8))
                     for temperature in (0.05, 1.0) for kind in ("plain", "equal", "zeros", "onehot")]


@pytest.mark.parametrize("vocab,block_len,temperature,kind", SINGLE_PATH_CASES)
def test_single_path_is_the_numpy_bv_and_token_rule(monkeypatch, vocab, block_len, temperature, kind):
    """BV and token-level sampling as one compiled call give the numpy forms' accepted length and next
    token, and draw the same uniforms (the next one agrees), on 40 seeds of sharp and flat rows, p = q,
    zeros in p and q (weights of 0), a one-hot target. The numpy forms are the ones the exact
    enumeration proves lossless (they take every random source; the compiled call only TorchRandom)."""
    from gbv.verify import token as token_module
    tokens, q, p = _path_instance(vocab, block_len, 7 * vocab + block_len, temperature, kind)
    calls = []
    spy = lambda *args: calls.append(1) or KERNELS.single_path(*args)  # noqa: E731
    for form in (block_module.block_verify_host, token_module.token_verify_host):
        with monkeypatch.context() as patch:
            spied = _without_single_path()
            spied.single_path = spy
            patch.setattr(common, "compiled_kernels", spied)
            compiled = _single_path_outcomes(monkeypatch, form, tokens, q, p, range(40), numpy_form=False)
        assert calls, "the compiled call did not run"
        calls.clear()
        assert compiled == _single_path_outcomes(monkeypatch, form, tokens, q, p, range(40), numpy_form=True)
    # The verifiers' own (K, L) inputs: path 0 of two, as the engine calls them.
    other_tokens, other_q, other_p = _path_instance(vocab, block_len, 5, 1.0, "plain")
    stacked = (torch.stack([tokens, other_tokens]), torch.stack([q, other_q]), torch.stack([p, other_p]))
    for name in ("block", "token"):
        verifier = get_verifier(name)
        form = lambda t, q_, p_, rng: tuple(vars(verifier(t, q_, p_, rng)).values())  # noqa: E731
        compiled = _single_path_outcomes(monkeypatch, form, *stacked, range(20), numpy_form=False)
        assert compiled == _single_path_outcomes(monkeypatch, form, *stacked, range(20), numpy_form=True)
        assert {outcome[0] for outcome in compiled} == {0}  # path 0


def test_the_single_path_check_catches_a_wrong_rule(monkeypatch):
    """Negative control: a compiled call with a wrong rule (token-level sampling's coins where BV's are
    due) fails the comparison above on the same instances."""
    tokens, q, p = _path_instance(700, 4, 11, 1.0, "plain")
    broken = _without_single_path()
    broken.single_path = lambda q_, p_, t_, L, V, block, *rest: KERNELS.single_path(q_, p_, t_, L, V, False, *rest)
    with monkeypatch.context() as patch:
        patch.setattr(common, "compiled_kernels", broken)
        wrong = _single_path_outcomes(monkeypatch, block_module.block_verify_host, tokens, q, p, range(40), False)
    assert wrong != _single_path_outcomes(monkeypatch, block_module.block_verify_host, tokens, q, p, range(40), True)


def test_single_path_runs_only_where_it_gives_the_numpy_results():
    """Not for other random sources (the enumerator's), float64 rows or strided rows; bad input -> one
    ValueError."""
    tokens, q, p = _path_instance(60, 3, 2, 1.0, "plain")
    rng = common.TorchRandom(torch.Generator().manual_seed(0))
    assert block_module.single_path_compiled(tokens, q, p, rng, True) is not None

    class OtherSource:
        def accept(self, prob):
            return True

        def sample(self, dist):
            return 0

    assert block_module.single_path_compiled(tokens, q, p, OtherSource(), True) is None
    assert block_module.single_path_compiled(tokens, q.double(), p, rng, True) is None
    assert block_module.single_path_compiled(tokens, q, p.t().contiguous().t(), rng, True) is None
    with pytest.raises(ValueError, match="outside the vocabulary"):
        KERNELS.single_path(q.numpy(), p.numpy(), np.array([0, 60, 1]), 3, 60, True, rng.uniform, np.empty(60),
                            1e-9, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        KERNELS.single_path(q.numpy(), p.numpy(), tokens.numpy(), 3, 61, True, rng.uniform, np.empty(60), 1e-9, 1.0)


def _adaptive_inputs(num_paths: int, block_len: int, vocab: int, temperature: float, kind: str, seed: int):
    """Engine-like float32 inputs of gbv-adaptive: (K, L) tokens drawn from q, paths sharing prefixes
    (a later path copies an earlier one's first tokens), each node's rows a function of its prefix."""
    gen = torch.Generator().manual_seed(seed)
    rows: dict[tuple, tuple] = {}

    def node(prefix: tuple) -> tuple:
        if prefix not in rows:
            p, q, _, _ = _rows(vocab, hash((seed,) + prefix) % 100_000, temperature, kind)
            rows[prefix] = (torch.from_numpy(q).float(), torch.from_numpy(p).float())
        return rows[prefix]

    paths: list[list[int]] = []
    for k in range(num_paths):
        shared = int(torch.randint(0, block_len + 1, (1,), generator=gen)) if paths else 0
        path = list(paths[int(torch.randint(0, len(paths), (1,), generator=gen))][:shared]) if shared else []
        while len(path) < block_len:
            q_row = node(tuple(path))[0]
            path.append(int(torch.multinomial(q_row.double(), 1, generator=gen)))
        paths.append(path)
    q = torch.stack([torch.stack([node(tuple(path[:d]))[0] for d in range(block_len)]) for path in paths])
    p = torch.stack([torch.stack([node(tuple(path[:d]))[1] for d in range(block_len + 1)]) for path in paths])
    return torch.tensor(paths), q.contiguous(), p.contiguous()


@pytest.mark.parametrize("num_paths,block_len", [(2, 1), (2, 4), (3, 4), (3, 8), (4, 8), (8, 3)])
@pytest.mark.parametrize("temperature,kind", [(0.2, "plain"), (1.0, "plain"), (1.0, "ties"), (1.0, "zeros")])
def test_fused_adaptive_selection_is_the_per_node_loop(monkeypatch, num_paths, block_len, temperature, kind):
    """verify_gbv_adaptive with its selection in one compiled call (adaptive_select) gives what the loop
    of adaptive_node / choose_next / adaptive_step gives, bit for bit, from the same uniforms, and uses
    as many of them; at V = 4096 (the compiled rows), over eight seeds."""
    for seed in range(8):
        tokens, q, p = _adaptive_inputs(num_paths, block_len, 4096, temperature, kind, seed)
        outcomes = []
        for fused in (True, False):
            monkeypatch.setattr(gbv_adaptive, "FUSED_SELECTION", fused)
            rng = common.TorchRandom(seed=seed)
            result = gbv_adaptive.verify_gbv_adaptive(tokens, q, p, rng)
            outcomes.append((result.path, result.accepted_len, result.next_token, rng.uniform()))
        assert outcomes[0] == outcomes[1], (seed, outcomes)


def test_the_fused_selection_check_catches_a_wrong_coin(monkeypatch):
    """Negative control of the test above: a selection whose coin is the complement (best token with
    probability 1 - lam) gives other outcomes for some seed."""
    differs = False
    for seed in range(8):
        tokens, q, p = _adaptive_inputs(3, 4, 4096, 1.0, "plain", seed)
        outcomes = []
        for flipped in (False, True):
            rng = common.TorchRandom(seed=seed)
            if flipped:
                accept = rng.accept
                monkeypatch.setattr(rng, "accept", lambda prob: accept(1.0 - prob))
            result = gbv_adaptive.verify_gbv_adaptive(tokens, q, p, rng)
            outcomes.append((result.path, result.accepted_len, result.next_token))
        differs = differs or outcomes[0] != outcomes[1]
    assert differs
