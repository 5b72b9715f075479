"""Traversal Verification's device form (:func:`gbv.verify.traversal.verify_traversal_on_device`:
what ``verify_traversal`` runs on a GPU, tensor code with one host read per call), held to the
checks of the host form: the tensor trie against the host trie (nodes, child order, post-order),
every shared exact check of ``exact_checks`` (bound below to the device form), losslessness by
enumeration on the grid, the SPEC section 10 values, K = 1 equals Block Verification, the host
form's outcome law per drafted tuple, and negative controls. Run on CPU tensors: the code is the
same on any device.
"""

from __future__ import annotations

import random

import pytest
import torch

from gbv.theory import random_instance
from gbv.verify import traversal
from gbv.verify.block import verify_block
from gbv.verify.traversal import _build_trie, _slot_trie, verify_traversal, verify_traversal_on_device

from exact_checks import (DEVICE_GRID, KINDS, check_device_form, check_reads_the_host_once, check_reference_value,
                          check_same_law, check_same_outcome_laws, max_error_on_negative_set, verifier_fixture)
# The exact checks shared with the other multi-path verifiers, collected here on the device form:
from exact_checks import test_temperature_zero, test_greedy_target_sampled_draft  # noqa: F401
from exact_checks import test_negative_control_set_is_lossless_unpatched, test_large_vocab_embeds_tiny  # noqa: F401

verifier = verifier_fixture(verify_traversal_on_device)


def _host_post_order(paths: list[list[int]]) -> list[tuple[int, int]]:
    """The host trie's nodes in post-order (the order the host form tests them), as (first path, depth)."""
    tree, order = _build_trie(paths), []

    def visit(node: int) -> None:
        for child in tree.children[node]:
            visit(child)
        order.append((tree.first_path[node], tree.depth[node]))

    visit(0)
    return order


def test_slot_trie_is_the_host_trie():
    """On random token sets (repeats, shared prefixes, identical paths): the canonical slots are the
    host trie's nodes, in its post-order, with its child positions and child counts."""
    rand = random.Random(0)
    for _ in range(300):
        num_paths, block_len, vocab = rand.randint(1, 4), rand.randint(1, 4), rand.randint(1, 3)
        paths = [[rand.randrange(vocab) for _ in range(block_len)] for _ in range(num_paths)]
        trie, tree = _slot_trie(torch.tensor(paths)), _build_trie(paths)
        slots = [(k, d) for k in range(num_paths) for d in range(block_len + 1) if trie.canonical[k, d]]
        assert sorted(slots, key=lambda s: int(trie.post_rank[s])) == _host_post_order(paths), paths
        for node in range(1, len(tree.parent)):
            slot = (tree.first_path[node], tree.depth[node])
            assert int(trie.child_index[slot]) == tree.children[tree.parent[node]].index(node), paths
            assert int(trie.num_children[slot]) == len(tree.children[node]), paths


@pytest.mark.parametrize("vocab,block_len,num_paths,kind", DEVICE_GRID)
def test_device_form_is_lossless(vocab, block_len, num_paths, kind):
    check_device_form(verify_traversal_on_device, verify_traversal, vocab, block_len, num_paths, kind)


@pytest.mark.parametrize("num_paths,expected", [(1, 11 / 9), (2, 115 / 81), (3, 1136 / 729)])
def test_spec_reference_values(num_paths, expected):
    check_reference_value(verify_traversal_on_device, num_paths, expected, tol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab,block_len,seed", [(3, 2, 0), (4, 3, 1), (2, 3, 2)])
def test_single_path_is_block_verification(vocab, block_len, seed, kind):
    check_same_law(verify_traversal_on_device, verify_block, random_instance(vocab, block_len, 1, seed, kind))


@pytest.mark.parametrize("vocab,block_len,num_paths,seed", [(3, 2, 3, 0), (4, 2, 2, 1), (3, 3, 2, 2)])
def test_outcome_law_is_the_host_forms(vocab, block_len, num_paths, seed):
    """Per drafted tuple, the law of (path, accepted length, next token) equals the host form's to
    1e-12 (the forms consume their randomness differently, so only laws can be compared)."""
    inst = random_instance(vocab, block_len, num_paths, seed, "mixed")
    check_same_outcome_laws(verify_traversal_on_device, verify_traversal, inst, tuples=40, tol=1e-12)


def test_float32_calls_read_the_host_once():
    check_reads_the_host_once(verify_traversal_on_device)


# ---------------------------------------------------------------------- negative controls
def test_not_zeroing_rejected_token_is_caught(monkeypatch):
    monkeypatch.setattr(traversal, "_remove_token_on_device", lambda dist_q, tokens: dist_q)
    assert max_error_on_negative_set(verify_traversal_on_device) > 1e-6


def test_not_updating_the_weight_is_caught(monkeypatch):
    real = traversal._reject_child_on_device

    def keeps_weight(w, dist_p, dist_q, tokens):
        return (w,) + real(w, dist_p, dist_q, tokens)[1:]

    monkeypatch.setattr(traversal, "_reject_child_on_device", keeps_weight)
    assert max_error_on_negative_set(verify_traversal_on_device) > 1e-6


def test_testing_deepest_nodes_first_is_caught(monkeypatch):
    """Broken order: children still before their parents, but every deeper node before every
    shallower one (sibling subtrees interleaved), not the post-order the weights assume."""
    real = traversal._slot_trie

    def deepest_first(draft_tokens):
        trie = real(draft_tokens)
        num_paths, block_len = draft_tokens.shape
        depth = torch.arange(block_len + 1).repeat(num_paths, 1)
        path = torch.arange(num_paths)[:, None]
        trie.post_rank = torch.where(trie.canonical, (block_len - depth) * num_paths + path, trie.post_rank.max() + 1)
        return trie

    monkeypatch.setattr(traversal, "_slot_trie", deepest_first)
    assert max_error_on_negative_set(verify_traversal_on_device) > 1e-6
