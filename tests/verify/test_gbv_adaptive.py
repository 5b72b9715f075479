"""gbv-adaptive (SPEC section 11): reference values, p = q, the two reductions (weight 1 = GBV,
weight 0 = BV), and negative controls caught by the same exact check as the real verifier.

Losslessness over every instance family runs once for every registered verifier, in the master
grid of test_lossless.py; the shared exact checks (temperature 0, large vocabulary) come from
``exact_checks``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from gbv.theory import context_free_instance, enumerate_branches, exact_analysis, random_instance
from gbv.verify import get_verifier, is_multi_path
from gbv.verify import common, gbv_adaptive
from gbv.verify.block import block_verify_path, verify_block
from gbv.verify.common import VerifyResult, check_shapes
from gbv.verify.gbv import SkewedLaw, path_walk, verify_gbv
from gbv.verify.gbv_adaptive import verify_gbv_adaptive, verify_gbv_adaptive_on_device
from gbv.verify import ranking
from gbv.verify.ranking import best_token

from exact_checks import (DEVICE_GRID, check_device_form, check_reference_value, check_same_law, coarse_buckets,
                          max_error_on_negative_set, tuple_inputs)
from test_lossless import law_error
# The exact checks shared with the other multi-path verifiers, collected here as this file's tests:
from exact_checks import test_temperature_zero, test_greedy_target_sampled_draft  # noqa: F401
from exact_checks import test_negative_control_set_is_lossless_unpatched, test_large_vocab_embeds_tiny  # noqa: F401

# What the shared tests run on: the host form and the device form (what runs on a GPU), both.
@pytest.fixture(name="verifier", params=[verify_gbv_adaptive, verify_gbv_adaptive_on_device], ids=["host", "device"])
def _both_forms(request):
    return request.param


def test_registry():
    assert get_verifier("gbv-adaptive") is verify_gbv_adaptive and is_multi_path("gbv-adaptive")


# SPEC section 11, reference values: p = (1/3, 2/3), q = (2/3, 1/3), L = 2.
@pytest.mark.parametrize("num_paths,expected", [(1, 11 / 9), (2, 131 / 81), (3, 1.8320987654), (4, 1.8615984405)])
def test_spec_reference_values(num_paths, expected):
    check_reference_value(verify_gbv_adaptive, num_paths, expected, tol=1e-9)


def _accepts_whole_block_on_every_tuple(inst, tuples) -> None:
    for paths in tuples:
        for result, prob in enumerate_branches(verify_gbv_adaptive, *tuple_inputs(inst, list(paths))):
            assert result.accepted_len == inst.block_len, (paths, result, prob)


@pytest.mark.parametrize("num_paths", [1, 2, 3, 4, 5])
def test_equal_draft_accepts_the_whole_block(num_paths):
    """p = q = (0.5, 0.3, 0.2) at every context, L = 2 (SPEC section 11; GBV accepts 1.4675 at K = 2):
    every branch of every tuple accepts L, so E[tau] = L exactly. All 9^K tuples up to K = 3, a seeded
    sample of 40 at K = 4, 5 (all 6561 / 59049 would take minutes)."""
    inst = context_free_instance([0.5, 0.3, 0.2], [0.5, 0.3, 0.2], 2, num_paths)
    seqs = list(itertools.product(range(3), repeat=2))
    if num_paths <= 3:
        check_reference_value(verify_gbv_adaptive, num_paths, 2.0, tol=1e-9, inst=inst)
        return
    rng = np.random.default_rng(num_paths)
    _accepts_whole_block_on_every_tuple(inst, [tuple(seqs[i] for i in rng.integers(len(seqs), size=num_paths))
                                               for _ in range(40)])


# ---------------------------------------------------------------------- the two reductions
REDUCTION_INSTANCES = [(3, 2, 2, 0, "mixed"), (3, 2, 3, 1, "dirichlet"), (2, 3, 2, 2, "truncated"),
                       (4, 1, 3, 3, "equal"), (2, 2, 3, 4, "sharp")]


def _forced_weight(value: float):
    return lambda p64, q64, below, num_paths: [0.0, 0.0] + [value] * (num_paths - 1)


@pytest.mark.parametrize("vocab,block_len,num_paths,seed,kind", REDUCTION_INSTANCES)
def test_weight_one_is_gbv(monkeypatch, vocab, block_len, num_paths, seed, kind):
    monkeypatch.setattr(gbv_adaptive, "node_weights", _forced_weight(1.0))
    check_same_law(verify_gbv_adaptive, verify_gbv, random_instance(vocab, block_len, num_paths, seed, kind))


@pytest.mark.parametrize("vocab,block_len,num_paths,seed,kind", REDUCTION_INSTANCES)
def test_weight_zero_is_block_verification(monkeypatch, vocab, block_len, num_paths, seed, kind):
    monkeypatch.setattr(gbv_adaptive, "node_weights", _forced_weight(0.0))
    check_same_law(verify_gbv_adaptive, verify_block, random_instance(vocab, block_len, num_paths, seed, kind))


def test_weight_one_selects_gbvs_path(monkeypatch):
    """Beyond the law: with weight 1 every tuple selects the very path GBV selects."""
    monkeypatch.setattr(gbv_adaptive, "node_weights", _forced_weight(1.0))
    inst = random_instance(3, 2, 3, 5, "mixed")
    seqs = [s for s in itertools.product(range(3), repeat=2) if inst.seq_prob(inst.draft, s) > 0]
    for paths in itertools.product(seqs, repeat=3):
        inputs = tuple_inputs(inst, list(paths))
        ours = {r.path for r, _ in enumerate_branches(verify_gbv_adaptive, *inputs)}
        assert ours == {r.path for r, _ in enumerate_branches(verify_gbv, *inputs)}, paths


# ---------------------------------------------------------------------- negative controls
def test_coins_drawn_from_the_drafts_are_caught(monkeypatch):
    def coin_from_drafts(candidates, keys, lam, rng):
        """The 'uniform' is read off the first candidate's draft (its ranking key), not drawn."""
        best = best_token(candidates, keys)
        return best if keys[0] / (1.0 + keys[0]) < lam else candidates[0]

    monkeypatch.setattr(gbv_adaptive, "choose_next", coin_from_drafts)
    assert max_error_on_negative_set(verify_gbv_adaptive) > 1e-6


def test_counts_not_updated_are_caught(monkeypatch):
    monkeypatch.setattr(gbv_adaptive, "update_counts", lambda counts, lams, q_s, below_s: counts)
    assert max_error_on_negative_set(verify_gbv_adaptive) > 1e-6


def published_gbv(draft_tokens, q, p, rng, eps: float = 1e-10) -> VerifyResult:
    """GBV as the published reference code does it (SPEC section 3): ranked by the capped ratio
    ``min(1, p / (q + eps))``; ties go to the first path in the selection, but to the *smaller* token id
    ranked lower in ``q_G`` (stable ascending sort, worst first)."""
    num_paths, block_len, _ = check_shapes(draft_tokens, q, p)
    tokens = draft_tokens.tolist()
    alive = list(range(num_paths))
    for depth in range(block_len):
        keys = [min(1.0, float(p[k, depth, tokens[k][depth]] / (q[k, depth, tokens[k][depth]] + eps))) for k in alive]
        first_best = alive[keys.index(max(keys))]
        alive = [k for k in alive if tokens[k][depth] == tokens[first_best][depth]]
    path = alive[0]
    q_path, p_path = q[path].double(), p[path].double()
    order = torch.sort((p_path[:block_len] / (q_path + eps)).clamp_max(1.0), dim=-1, stable=True).indices
    q_sorted = q_path.gather(-1, order)
    below = torch.zeros_like(q_path).scatter_(-1, order, q_sorted.cumsum(-1) - q_sorted)
    s = draft_tokens[path]
    v, u = path_walk(below.gather(-1, s.unsqueeze(-1)).squeeze(-1).tolist(),
                     q_path.gather(-1, s.unsqueeze(-1)).squeeze(-1).tolist())
    law = SkewedLaw(torch.tensor(v, dtype=torch.float64), torch.tensor(u, dtype=torch.float64), num_paths)
    q_g = law.token_law(torch.arange(block_len).unsqueeze(-1), below, q_path)
    return VerifyResult(path, *block_verify_path(s, q_g, p_path, rng))


def test_published_capped_ratio_gbv_is_caught():
    assert max_error_on_negative_set(published_gbv) > 1e-6


def test_published_gbv_is_lossless_where_at_most_one_token_has_p_above_q():
    """The control's own sanity: the flaw needs two tokens with p > q (SPEC section 3), so on the
    section 10 example (one such token) the published code is lossless and equals our GBV."""
    check_same_law(published_gbv, verify_gbv, context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2, 3))



# ---------------------------------------------------------------------- the node weight, and large vocabularies
def _one_step_acceptance(p64, q64, below, n, lam):
    """F(lam) = sum_x min(p_x, (1 - lam) q_x + lam g_n(x)), directly from its definition."""
    g = gbv_adaptive.greedy_step_law(below, q64, n)
    return torch.minimum(p64, (1.0 - lam) * q64 + lam * g).sum()


def _node_rows(vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q_logits = 2.0 * torch.randn(vocab, generator=gen, dtype=torch.float64)
    q64 = torch.softmax(q_logits, -1)
    p64 = torch.softmax(q_logits + torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    below = ranking.mass_below_rows(ranking.ranking_key(p64, q64)[None], q64[None])[0]  # exact W
    return p64, q64, below


# Every search of the crossing breakpoint on every row: numpy's sorted (short rows) and binned (long
# rows), and the compiled one (gbv/verify/_verify_kernels.c, what an install with a C compiler runs).
SEARCHES = {"sorted": 10**9, "binned": 0, "compiled": None}


def _use_search(monkeypatch, search: str) -> None:
    if search == "compiled":
        if common.compiled_kernels is None:
            pytest.skip("gbv.verify._verify_kernels is not built (no C compiler at install)")
        return
    monkeypatch.setattr(common, "compiled_kernels", None)
    monkeypatch.setattr(gbv_adaptive, "_SORT_MAX_VOCAB", SEARCHES[search])


@pytest.mark.parametrize("search", sorted(SEARCHES))
@pytest.mark.parametrize("vocab,seed", [(5, 0), (50, 1), (2000, 2)])
def test_node_weight_is_the_smallest_maximiser(monkeypatch, vocab, seed, search):
    """Either breakpoint search finds what a brute force over every breakpoint finds: the largest
    F (to rounding) and, among the maximisers, the smallest weight."""
    _use_search(monkeypatch, search)
    p64, q64, below = _node_rows(vocab, seed)
    lams = gbv_adaptive.node_weights(p64, q64, below, 4)
    assert lams[:2] == [0.0, 0.0]
    for n in (2, 3, 4):
        d = gbv_adaptive.greedy_step_law(below, q64, n) - q64
        t = (p64 - q64) / d
        candidates = torch.cat([torch.tensor([0.0, 1.0], dtype=torch.float64), t[(t > 0) & (t < 1)]])
        values = torch.stack([_one_step_acceptance(p64, q64, below, n, c) for c in candidates.tolist()])
        best = values.max()
        ours = _one_step_acceptance(p64, q64, below, n, lams[n])
        assert ours >= best - 1e-12, (n, float(best - ours))
        smallest = candidates[values >= best - 1e-12].min()
        assert lams[n] == pytest.approx(float(smallest), abs=1e-9), n


@pytest.mark.parametrize("search", sorted(SEARCHES))
@pytest.mark.parametrize("vocab,seed", [(4096, 3), (32768, 4)])
def test_node_weight_matches_a_full_sort_of_the_breakpoints(monkeypatch, vocab, seed, search):
    """At real vocabulary sizes (too many breakpoints for the brute force): the first breakpoint where
    the slope of F stops being positive, from a full sort of all breakpoints and a running sum."""
    _use_search(monkeypatch, search)
    p64, q64, below = _node_rows(vocab, seed)
    lams = gbv_adaptive.node_weights(p64, q64, below, 4)
    diff = p64 - q64
    for n in (2, 3, 4):
        d = gbv_adaptive.greedy_step_law(below, q64, n) - q64
        slope0 = float(torch.where(((d > 0) & (diff > 0)) | ((d < 0) & (diff >= 0)), d, 0.0).sum())
        t = diff / d
        events = (t > 0) & (t < 1)
        t_sorted, order = torch.sort(t[events])
        reached = (slope0 - d[events].abs()[order].cumsum(0)) <= 0.0
        expected = 0.0 if slope0 <= 0 else (float(t_sorted[reached.nonzero()[0, 0]]) if reached.any() else 1.0)
        assert lams[n] == pytest.approx(expected, abs=1e-12), n
        ours, ref = (_one_step_acceptance(p64, q64, below, n, lam) for lam in (lams[n], expected))
        assert float(ours) == pytest.approx(float(ref), abs=1e-12)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float64, torch.float64),
                                    (torch.float32, torch.float64), (torch.bfloat16, torch.float32)])
def test_ranking_key_of_arrays_is_the_tensor_key(dtypes):
    """The host form computes its keys on numpy rows; they must be the very keys of the tensor code
    (the residual masses and every device form use those), zeros, p = q = 0 and q = 0 < p included."""
    gen = torch.Generator().manual_seed(11)
    p, q = (torch.rand(3, 500, generator=gen, dtype=torch.float64) ** 4 for _ in range(2))
    p[:, :40] = 0.0
    q[:, 20:60] = 0.0
    p[1] = q[1]
    p, q = p.to(dtypes[0]), q.to(dtypes[1])
    ours = ranking.ranking_key(ranking.host_array(p), ranking.host_array(q))
    theirs = ranking.ranking_key(p, q).numpy()
    assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
    assert (theirs == ranking.ZERO_ZERO_KEY).any() and np.isinf(theirs).any()


def test_flat_row_weights_from_key_buckets():
    """host_node_weights on a flat row (V = 4096, T = 1 like): the occupied key buckets stand for the
    tokens. Where every bucket holds one token that is the exact search, to rounding; on a real-sized
    row the weight loses little F against the exact one (the bundled pair: ~3e-4 on average)."""
    gen = torch.Generator().manual_seed(12)
    vocab = 4096
    q64 = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64), -1).float().double()
    p64 = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64), -1).float().double()
    key = ranking.ranking_key(p64.float(), q64.float())
    assert int((q64 > gbv_adaptive._WEIGHT_MASS_CUT / vocab).sum()) == vocab  # not cut
    lams = gbv_adaptive.host_node_weights(p64.numpy(), q64.numpy(), key.numpy(), 4)
    assert any(0.0 < lam < 1.0 for lam in lams[2:])
    assert max(_weight_loss(p64, q64, key, lams, 4)) < 1e-3
    # Where each occupied bucket holds one token, the buckets are those tokens: their q, p and exact W
    # in key order (here 300 tokens whose keys p / q are 1.2x apart; every other token has p = q = 0).
    tokens = torch.randperm(vocab, generator=gen)[:300]
    q1 = torch.zeros(vocab, dtype=torch.float64)
    q1[tokens] = torch.rand(300, generator=gen, dtype=torch.float64) + 0.1
    q1 /= q1.sum()
    p1 = torch.zeros_like(q1)
    p1[tokens] = q1[tokens] * 1.2 ** torch.arange(-150, 150, dtype=torch.float64)[torch.randperm(300, generator=gen)]
    key1 = ranking.ranking_key(p1.float(), q1.float())
    mass_q, mass_p, below = ranking.occupied_bucket_masses(key1.numpy(), q1.numpy(), p1.numpy())
    order = tokens[torch.argsort(key1[tokens])]
    exact_below = ranking.mass_below_rows(key1[None], q1[None])[0]
    assert np.array_equal(mass_q, q1[order].numpy()) and np.array_equal(mass_p, p1[order].numpy())
    assert np.abs(below - exact_below[order].numpy()).max() < 1e-15


def _sharp_node(seed: int, vocab: int = 4096):
    """A node like the bundled pair's at T = 0.2: both rows sharp, most of q below 1e-10."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(vocab, generator=gen, dtype=torch.float64)
    q64 = torch.softmax(logits / 0.2, -1).float().double()
    p64 = torch.softmax((logits + 0.3 * torch.randn(vocab, generator=gen, dtype=torch.float64)) / 0.2, -1)
    key = ranking.ranking_key(p64.float(), q64.float())
    return p64, q64, key


def _weight_loss(p64, q64, key, lams, num_paths):
    """F(exact weight) - F(lams[n]) per n, both on the whole row with the exact W."""
    below = ranking.mass_below_rows(key[None], q64[None])[0]
    exact = gbv_adaptive.node_weights(p64, q64, below, num_paths)
    return [float(_one_step_acceptance(p64, q64, below, n, exact[n]) - _one_step_acceptance(p64, q64, below, n, lams[n]))
            for n in range(2, num_paths + 1)]


@pytest.mark.parametrize("seed", [0, 3, 4])
def test_host_weights_of_a_sharp_row_lose_at_most_the_cut_mass(seed):
    """host_node_weights cuts a sharp row to its tokens with q > 1e-6 / V; what it leaves out holds at
    most 1e-6 of q, so the weight found may lose at most ~2 n 1e-6 of F against the exact weight."""
    p64, q64, key = _sharp_node(seed)
    cut = int((q64 > gbv_adaptive._WEIGHT_MASS_CUT / 4096).sum())
    assert 1 < cut < 2048  # the cut is taken (and leaves more than one token)
    lams = gbv_adaptive.host_node_weights(p64.numpy(), q64.numpy(), key.numpy(), 4)
    assert lams[:2] == [0.0, 0.0] and any(0.0 < lam < 1.0 for lam in lams[2:])
    assert max(_weight_loss(p64, q64, key, lams, 4)) < 1e-5


def test_a_cut_of_real_mass_is_caught(monkeypatch):
    """Negative control of the test above: cutting at 0.3 / V instead (tokens that carry mass) loses
    more than the bound on the same rows."""
    monkeypatch.setattr(gbv_adaptive, "_WEIGHT_MASS_CUT", 0.3)
    losses = []
    for seed in (0, 3, 4):
        p64, q64, key = _sharp_node(seed)
        losses += _weight_loss(p64, q64, key, gbv_adaptive.host_node_weights(p64.numpy(), q64.numpy(), key.numpy(), 4), 4)
    assert max(losses) > 1e-5, losses


def test_weight_of_an_equal_draft_is_zero():
    q64 = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    below = torch.tensor([0.5, 0.2, 0.0], dtype=torch.float64)
    assert gbv_adaptive.node_weights(q64.clone(), q64, below, 4) == [0.0] * 5


@pytest.mark.parametrize("vocab,length,num_paths,kind", [(3, 2, 2, "dirichlet"), (3, 2, 3, "mixed"),
                                                         (2, 3, 3, "truncated"), (4, 2, 2, "sharp"),
                                                         (4, 2, 3, "sharp")])
def test_bucketed_code_paths_are_lossless(monkeypatch, vocab, length, num_paths, kind):
    """The large-vocabulary code (node weights from key buckets or from a cut row, bucketed residual
    masses), forced on tiny instances and proven lossless by the same exact enumeration; a weight
    that is not the exact maximiser changes the acceptance, never the law."""
    coarse_buckets(monkeypatch)
    inst = random_instance(vocab, length, num_paths, 7, kind)
    assert law_error(verify_gbv_adaptive, inst, num_paths) < 1e-9


def _bucket_floor_mass_below(key, q64, tokens):
    """A wrong on-path W: the q-mass of the key buckets below each token's own (its bucket's worse
    tokens left out), as the flat-row node weights see it."""
    ids = ranking._bucket_ids(key)
    return np.array([q64[row][ids[row] < ids[row, token]].sum() for row, token in enumerate(tokens)])


def test_bucketed_ranks_in_the_law_are_caught(monkeypatch):
    """Negative control of the test above: using bucket-level ranks in the law of the selected path,
    instead of only in the weights, is lossy and the same check sees it."""
    coarse_buckets(monkeypatch)
    monkeypatch.setattr(gbv_adaptive, "mass_below_array", _bucket_floor_mass_below)
    errors = [law_error(verify_gbv_adaptive, random_instance(v, l, k, 7, kind), k)
              for v, l, k, kind in [(3, 2, 2, "dirichlet"), (3, 2, 3, "mixed"), (4, 2, 2, "sharp")]]
    assert max(errors) > 1e-6, errors


# ---------------------------------------------------------------------- the device form
# verify_gbv_adaptive_on_device (what verify_gbv_adaptive runs on a GPU; one host read per call) is
# production code too: the exact checks above (temperature 0, large vocabulary, the negative set)
# run on it through the fixture, and these on its own parts, on CPU tensors.
@pytest.mark.parametrize("vocab,block_len,num_paths,kind", DEVICE_GRID)
def test_device_form_is_lossless(vocab, block_len, num_paths, kind):
    """The master grid's instances (K > 1); below V = 4096 both forms use the exact W in the weights,
    so their expected accepted lengths agree too."""
    check_device_form(verify_gbv_adaptive_on_device, verify_gbv_adaptive, vocab, block_len, num_paths, kind)


@pytest.mark.parametrize("num_paths", [2, 3])
def test_device_form_spec_reference_values(num_paths):
    inst = context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2, num_paths)
    ours = exact_analysis(verify_gbv_adaptive_on_device, inst).expected_accepted
    assert ours == pytest.approx(exact_analysis(verify_gbv_adaptive, inst).expected_accepted, abs=1e-12)


def _forced_weight_on_device(value: float):
    return lambda p64, q64, below, num_paths: torch.cat([q64.new_zeros(1), q64.new_full((num_paths - 1,), value)])


@pytest.mark.parametrize("vocab,block_len,num_paths,seed,kind", [i for i in REDUCTION_INSTANCES if i[:3] != (3, 2, 3)])
def test_device_form_reductions(monkeypatch, vocab, block_len, num_paths, seed, kind):
    """Weight 1 everywhere is GBV, weight 0 everywhere BV on path 0, through the device form's
    selection, counts and law."""
    inst = random_instance(vocab, block_len, num_paths, seed, kind)
    monkeypatch.setattr(gbv_adaptive, "node_weights_on_device", _forced_weight_on_device(1.0))
    check_same_law(verify_gbv_adaptive_on_device, verify_gbv, inst)
    monkeypatch.setattr(gbv_adaptive, "node_weights_on_device", _forced_weight_on_device(0.0))
    check_same_law(verify_gbv_adaptive_on_device, verify_block, inst)


@pytest.mark.parametrize("vocab,seed", [(5, 0), (50, 1), (2000, 2), (4096, 3)])
def test_device_node_weights_equal_the_host_ones(vocab, seed):
    """One sort of the breakpoints finds the weight the binned search finds (same exact W)."""
    p64, q64, below = _node_rows(vocab, seed)
    host = gbv_adaptive.node_weights(p64, q64, below, 4)
    device = gbv_adaptive.node_weights_on_device(p64, q64, below, 4)
    assert device.shape == (4,) and float(device[0]) == 0.0
    for n in (2, 3, 4):
        assert float(device[n - 1]) == pytest.approx(host[n], abs=1e-12), n
    assert gbv_adaptive.node_weights_on_device(q64.clone(), q64, below, 4).tolist() == [0.0] * 4


def test_device_counts_update_equals_the_host_one():
    gen = torch.Generator().manual_seed(9)
    for num_paths in (2, 3, 5):
        kernels = gbv_adaptive._count_kernels(num_paths, torch.device("cpu"))
        for _ in range(20):
            counts = torch.rand(num_paths, generator=gen, dtype=torch.float64)
            counts /= counts.sum()
            lams = torch.rand(num_paths, generator=gen, dtype=torch.float64)
            lams[0] = 0.0
            q_s, below_s = torch.rand(2, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 0.5])
            host = gbv_adaptive.update_counts([0.0, *counts.tolist()], [0.0, *lams.tolist()], float(q_s), float(below_s))
            device = gbv_adaptive.update_counts_on_device(counts, lams, q_s.reshape(1), below_s.reshape(1), kernels)
            assert torch.allclose(device, torch.tensor(host[1:], dtype=torch.float64), atol=1e-15, rtol=1e-12)


def test_device_form_counts_not_updated_are_caught(monkeypatch):
    monkeypatch.setattr(gbv_adaptive, "update_counts_on_device", lambda counts, lams, q_s, below_s, kernels: counts)
    assert max_error_on_negative_set(verify_gbv_adaptive_on_device) > 1e-6


def test_device_form_inconsistent_ranking_is_caught(monkeypatch):
    """The law's W ranked by q alone while the selection ranks by p / q."""
    monkeypatch.setattr(gbv_adaptive, "mass_below_rows_sorted", lambda key, q64: ranking.mass_below_rows_sorted(q64, q64))
    assert max_error_on_negative_set(verify_gbv_adaptive_on_device) > 1e-6


# ---------------------------------------------------------------------- inputs the host form converts
@pytest.mark.parametrize("method", ["gbv", "gbv-adaptive"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_host_form_takes_half_and_strided_inputs(method, dtype):
    """The host forms work on numpy views of the rows: half-precision rows (bfloat16, which numpy
    lacks, goes through float32) and strided views must give exactly what the same values give as
    contiguous float32 rows, at a vocabulary on the bucketed code paths."""
    from gbv.verify import TorchRandom

    gen = torch.Generator().manual_seed(13)
    vocab, num_paths, block_len = 4096, 3, 4
    q = torch.softmax(2.0 * torch.randn(num_paths, block_len, vocab, generator=gen), -1).to(dtype)
    p = torch.softmax(2.0 * torch.randn(num_paths, block_len + 1, vocab, generator=gen), -1).to(dtype)
    tokens = torch.multinomial(q.float().reshape(-1, vocab), 1, generator=gen).reshape(num_paths, block_len)
    # A strided p: every other column of a wider tensor holding the same values.
    wide = torch.zeros(num_paths, block_len + 1, 2 * vocab, dtype=dtype)
    wide[..., ::2] = p
    verifier = get_verifier(method)
    for seed in range(6):
        ours = verifier(tokens, q, wide[..., ::2], TorchRandom(torch.Generator().manual_seed(seed)))
        ref = verifier(tokens, q.float(), p.float(), TorchRandom(torch.Generator().manual_seed(seed)))
        assert (ours.path, ours.accepted_len, int(ours.next_token)) == (ref.path, ref.accepted_len,
                                                                        int(ref.next_token)), seed
