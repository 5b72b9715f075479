"""The compiled helpers of the verifiers' host forms (gbv/verify/_verify_kernels.c) against the numpy
code they replace: ``occupied_bucket_masses`` and ``mass_below_among`` bit for bit (the same sums in
the same order), ``node_weights`` to rounding, on rows with ties, zeros, p = q, q = 0 < p (infinite
keys), -0.0 keys and sharp temperatures. The weights' own correctness (the smallest maximiser of F)
is tests/verify/test_gbv_adaptive.py's brute force, run on every search including the compiled one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gbv.verify import common, gbv_adaptive, ranking

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
