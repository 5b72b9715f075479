"""The exact enumerator itself: branch probabilities, completion of the law, and that it sees errors."""

import math

import pytest
import torch

from gbv.theory import context_free_instance, enumerate_branches, exact_analysis, random_instance
from gbv.verify import VerifyResult, get_verifier


def _inputs(seed: int, num_paths: int = 2, block_len: int = 2, vocab: int = 3):
    inst = random_instance(vocab, block_len, num_paths, seed)
    tokens = torch.zeros(num_paths, block_len, dtype=torch.long)
    q = torch.stack([torch.stack([torch.from_numpy(inst.draft[()])] * block_len)] * num_paths)
    p = torch.stack([torch.stack([torch.from_numpy(inst.target[()])] * (block_len + 1))] * num_paths)
    q[:, :, 0] = q[:, :, 0].clamp_min(0.1)  # token 0 must be draftable
    q = q / q.sum(-1, keepdim=True)
    return tokens, q, p


@pytest.mark.parametrize("method", ["token", "block"])
def test_branch_probabilities_sum_to_one(method):
    for seed in range(5):
        leaves = enumerate_branches(get_verifier(method), *_inputs(seed))
        assert math.isclose(sum(prob for _, prob in leaves), 1.0, abs_tol=1e-12)
        assert all(prob > 0 for _, prob in leaves)


def test_sample_branches_follow_the_distribution():
    dist = torch.tensor([0.25, 0.0, 0.75], dtype=torch.float64)

    def draw(tokens, q, p, rng):
        return VerifyResult(0, 0, rng.sample(dist))

    leaves = enumerate_branches(draw, *_inputs(0))
    assert sorted((r.next_token, prob) for r, prob in leaves) == [(0, 0.25), (2, 0.75)]


def test_unnormalised_sampling_is_rejected():
    def bad(tokens, q, p, rng):
        return VerifyResult(0, 0, rng.sample(torch.tensor([0.5, 0.6], dtype=torch.float64)))

    with pytest.raises(AssertionError, match="unnormalised"):
        enumerate_branches(bad, *_inputs(0))


def test_exact_law_catches_a_plain_draft_sampler():
    """Accepting every drafted token (emitting the draft law) must show up as a law error."""

    def accept_all(tokens, q, p, rng):
        return VerifyResult(0, tokens.shape[1], rng.sample(p[0, -1]))

    inst = context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2, 1)
    assert exact_analysis(accept_all, inst).max_law_error > 0.1
    assert exact_analysis(get_verifier("token"), inst).max_law_error < 1e-12


def test_spec_reference_values_single_path():
    inst = context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2, 1)
    assert exact_analysis(get_verifier("token"), inst).expected_accepted == pytest.approx(10 / 9, abs=1e-12)
    assert exact_analysis(get_verifier("block"), inst).expected_accepted == pytest.approx(11 / 9, abs=1e-12)
