"""Traversal Verification over the trie of the K paths (SPEC section 6).

Exact losslessness by enumeration (:func:`gbv.theory.exact_analysis` replays every branch of the very
verifier code), SPEC section 10 values, K = 1 equals Block Verification, temperature 0 (SPEC
section 8), and negative controls caught by the same exact check: duplicate i.i.d. children kept as
separate siblings, and the rejected token not zeroed in Q_u. The checks shared with the other
multi-path verifiers come from ``exact_checks``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gbv.theory import enumerate_branches, random_instance
from gbv.verify import get_verifier
from gbv.verify import traversal
from gbv.verify.block import verify_block
from gbv.verify.traversal import verify_traversal

from exact_checks import KINDS, check_reference_value, check_same_law, max_error_on_negative_set, verifier_fixture
# The exact checks shared with the other multi-path verifiers, collected here as this file's tests:
from exact_checks import test_temperature_zero  # noqa: F401
from exact_checks import test_greedy_target_sampled_draft, test_negative_control_set_is_lossless_unpatched  # noqa: F401
from exact_checks import test_large_vocab_embeds_tiny  # noqa: F401

verifier = verifier_fixture(verify_traversal)  # what the shared tests run on


@pytest.mark.parametrize("num_paths,expected", [(1, 11 / 9), (2, 115 / 81), (3, 1136 / 729)])
def test_spec_reference_values(num_paths, expected):
    check_reference_value(verify_traversal, num_paths, expected, tol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab,block_len,seed", [(3, 2, 0), (4, 3, 1), (2, 3, 2), (3, 3, 3)])
def test_single_path_is_block_verification(vocab, block_len, seed, kind):
    check_same_law(verify_traversal, verify_block, random_instance(vocab, block_len, 1, seed, kind))


def test_registry():
    assert get_verifier("traversal") is verify_traversal


# ---------------------------------------------------------------------- negative control
def test_duplicate_children_as_separate_siblings_is_caught(monkeypatch):
    def no_merging(paths):
        """Every path its own chain from the root: equal i.i.d. children stay separate siblings."""
        tree = traversal._Tree([-1], [-1], [0], [0], [[]])
        for k, path in enumerate(paths):
            node = 0
            for i, tok in enumerate(path):
                child = len(tree.parent)
                tree.parent.append(node)
                tree.token.append(tok)
                tree.depth.append(i + 1)
                tree.first_path.append(k)
                tree.children.append([])
                tree.children[node].append(child)
                node = child
        return tree

    monkeypatch.setattr(traversal, "_build_trie", no_merging)
    assert max_error_on_negative_set(verify_traversal) > 1e-6


def test_not_zeroing_rejected_token_is_caught(monkeypatch):
    monkeypatch.setattr(traversal, "_remove_token", lambda q_u, tok: q_u)
    assert max_error_on_negative_set(verify_traversal) > 1e-6


# ---------------------------------------------------------------------- the trie
def test_trie_merges_prefixes_in_first_appearance_order():
    tree = traversal._build_trie([[2, 0], [1, 1], [2, 1], [1, 1], [2, 0]])
    assert tree.children[0] == [1, 3]  # root -> 2 (path 0), 1 (path 1)
    assert [tree.token[c] for c in tree.children[1]] == [0, 1]
    assert [tree.first_path[c] for c in tree.children[1]] == [0, 2]
    assert len(tree.parent) == 1 + 2 + 3  # root, {2, 1}, {20, 11, 21}
    assert tree.depth == [0, 1, 2, 1, 2, 2]


def test_identical_paths_are_one_chain():
    """K copies of one path form a single chain: same law as BV on it."""
    inst = random_instance(3, 2, 1, 5, "mixed")
    q = torch.from_numpy(np.stack([inst.draft[()], inst.draft[(1,)]]))
    p = torch.from_numpy(np.stack([inst.target[()], inst.target[(1,)], inst.target[(1, 0)]]))
    tokens = torch.tensor([[1, 0]])

    def law(verifier, copies):
        out = {}
        for result, prob in enumerate_branches(verifier, tokens.repeat(copies, 1), q.repeat(copies, 1, 1),
                                               p.repeat(copies, 1, 1)):
            key = (result.accepted_len, result.next_token)
            out[key] = out.get(key, 0.0) + prob
        return out

    ref = law(verify_block, 1)
    for copies in (1, 3):
        ours = law(verify_traversal, copies)
        assert set(ours) == set(ref)
        assert all(abs(ours[key] - ref[key]) < 1e-12 for key in ref)
