"""BV's path weights (gbv.verify.block.path_weights), from which ``auto`` rates its BV arms: by exact
enumeration, ``sum_{i <= m} E[w_i]`` over paths drafted for a block of L is BV's expected accepted
length with a block of m, for every m <= L (SPEC section 2), and ``w_i`` is the chance that a block of
any length keeps the first i drafted tokens, given them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from gbv.theory import enumerate_branches, exact_analysis, random_instance
from gbv.theory.instance import TinyInstance
from gbv.verify import get_verifier
from gbv.verify.block import block_weights, path_weights

from exact_checks import KINDS, path_tensors, tuple_inputs


def _paths(inst: TinyInstance):
    """Every drafted path of the instance's block length with its probability under the draft."""
    for seq in itertools.product(range(inst.vocab), repeat=inst.block_len):
        prob = inst.seq_prob(inst.draft, seq)
        if prob > 0.0:
            yield seq, prob


def _weights(inst: TinyInstance, seq) -> list[float]:
    q, p = path_tensors(inst, seq)
    return path_weights(torch.tensor(seq), q, p)


def _shorter(inst: TinyInstance, block_len: int) -> TinyInstance:
    """The same tables with a shorter block (contexts past it are never read)."""
    return TinyInstance(inst.vocab, block_len, 1, inst.target, inst.draft)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab,block_len", [(2, 3), (3, 3), (4, 2), (2, 4)])
def test_weights_give_the_expected_accepted_length_of_every_shorter_block(vocab, block_len, kind):
    for rep in range(3):
        inst = random_instance(vocab, block_len, 1, seed=900 + 31 * rep + 7 * vocab + block_len, kind=kind)
        mean_weights = np.zeros(block_len)
        for seq, prob in _paths(inst):
            weights = _weights(inst, seq)
            assert len(weights) == block_len and all(0.0 <= w <= 1.0 for w in weights)
            mean_weights += prob * np.array(weights)
        for m in range(1, block_len + 1):
            expected = exact_analysis(get_verifier("block"), _shorter(inst, m)).expected_accepted
            assert mean_weights[:m].sum() == pytest.approx(expected, abs=1e-12), (kind, rep, m)


@pytest.mark.parametrize("kind", KINDS)
def test_each_weight_is_the_chance_that_its_prefix_is_kept_in_a_longer_block(kind):
    # P(tau_L >= i | x_1..x_i) = w_i(x_1..x_i) for every L >= i: each path's chance, by enumerating the
    # verifier's coins, averaged over the paths that share the prefix. So the accepted lengths pool
    # across block lengths without bias too, and w_i is their conditional mean (less variance).
    inst = random_instance(3, 3, 1, seed=970 + KINDS.index(kind), kind=kind)
    reach = {}  # prefix -> (sum over paths of q(path) P(tau >= len(prefix) | path), q(prefix))
    for seq, prob in _paths(inst):
        tokens, q, p = tuple_inputs(inst, [seq])
        leaves = enumerate_branches(get_verifier("block"), tokens, q, p)
        for i in range(1, inst.block_len + 1):
            kept = sum(chance for result, chance in leaves if result.accepted_len >= i)
            total, mass = reach.get(seq[:i], (0.0, 0.0))
            reach[seq[:i]] = (total + prob * kept, mass + prob)
    weights = {seq[:i]: w for seq, _ in _paths(inst) for i, w in enumerate(_weights(inst, seq), start=1)}
    for prefix, (total, mass) in reach.items():
        assert total / mass == pytest.approx(weights[prefix], abs=1e-12), prefix


def test_a_wrong_weight_is_caught():
    # The negative control of the first test: token-level acceptance products (prod_j min(1, r_j)),
    # what a token verifier keeps, are not BV's weights; the same check fails on them.
    gaps = []
    for seed in range(4):
        inst = random_instance(3, 3, 1, seed=990 + seed, kind="mixed")
        token_level = 0.0
        for seq, prob in _paths(inst):
            q, p = path_tensors(inst, seq)
            ratios = [float(p[i, t] / q[i, t]) for i, t in enumerate(seq)]
            token_level += prob * sum(np.cumprod(np.minimum(ratios, 1.0)))
        gaps.append(abs(token_level - exact_analysis(get_verifier("block"), inst).expected_accepted))
    assert max(gaps) > 1e-3


def test_block_weights_follow_the_spec_recursion():
    assert block_weights([0.5, 4.0, 0.25, float("inf"), 0.0]) == [1.0, 0.5, 1.0, 0.25, 1.0, 0.0]
    assert block_weights([]) == [1.0]
