"""Traversal Verification over the trie of the K paths (SPEC section 6).

Exact losslessness by enumeration (:func:`gbv.theory.exact_analysis` replays every branch of the very
verifier code), SPEC section 10 values, K = 1 equals Block Verification, temperature 0 (SPEC
section 8), and negative controls caught by the same exact check: duplicate i.i.d. children kept as
separate siblings, and the rejected token not zeroed in Q_u.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from gbv.theory import context_free_instance, enumerate_branches, exact_analysis, random_instance
from gbv.theory.instance import TinyInstance
from gbv.verify import TorchRandom, get_verifier
from gbv.verify import traversal
from gbv.verify.block import verify_block
from gbv.verify.traversal import verify_traversal

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
    assert exact_analysis(verify_traversal, inst).max_law_error < LOSSLESS_TOL


@pytest.mark.parametrize("vocab,block_len,num_paths,kind", FAST)
def test_lossless_exact(vocab, block_len, num_paths, kind):
    _lossless(vocab, block_len, num_paths, kind)


@pytest.mark.slow
@pytest.mark.parametrize("vocab,block_len,num_paths,kind", SLOW)
def test_lossless_exact_large(vocab, block_len, num_paths, kind):
    _lossless(vocab, block_len, num_paths, kind)


@pytest.mark.parametrize("num_paths,expected", [(1, 11 / 9), (2, 115 / 81), (3, 1136 / 729)])
def test_spec_reference_values(num_paths, expected):
    inst = context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2, num_paths)
    result = exact_analysis(verify_traversal, inst)
    assert result.expected_accepted == pytest.approx(expected, abs=1e-12)
    assert result.max_law_error < 1e-12


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab,block_len,seed", [(3, 2, 0), (4, 3, 1), (2, 3, 2), (3, 3, 3)])
def test_single_path_is_block_verification(vocab, block_len, seed, kind):
    inst = random_instance(vocab, block_len, 1, seed, kind)
    ours, ref = exact_analysis(verify_traversal, inst), exact_analysis(verify_block, inst)
    assert ours.expected_accepted == pytest.approx(ref.expected_accepted, abs=1e-12)
    for out in set(ours.emitted_law) | set(ref.emitted_law):
        assert ours.emitted_law.get(out, 0.0) == pytest.approx(ref.emitted_law.get(out, 0.0), abs=1e-12)


def test_registry():
    assert get_verifier("traversal") is verify_traversal


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
    assert _check_greedy(verify_traversal, greedy) >= 1


@pytest.mark.parametrize("kind", ["mixed", "sharp", "truncated"])
def test_greedy_target_sampled_draft(kind):
    """One-hot p, stochastic q (paths differ): still the longest matching prefix over all paths."""
    base = random_instance(3, 2, 3, 7, kind)
    inst = TinyInstance(3, 2, 3, _one_hot(base.target), base.draft)
    assert _check_greedy(verify_traversal, inst) >= 1


# ---------------------------------------------------------------------- negative control
NEGATIVE_INSTANCES = [(3, 1, 2, 0), (3, 1, 2, 1), (4, 1, 3, 0), (3, 2, 2, 0)]


def _max_error_on_negative_set() -> float:
    return max(exact_analysis(verify_traversal, random_instance(v, l, k, s, "dirichlet")).max_law_error
               for v, l, k, s in NEGATIVE_INSTANCES)


def test_negative_control_set_is_lossless_unpatched():
    assert _max_error_on_negative_set() < LOSSLESS_TOL


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
    assert _max_error_on_negative_set() > 1e-6


def test_not_zeroing_rejected_token_is_caught(monkeypatch):
    monkeypatch.setattr(traversal, "_remove_token", lambda q_u, tok: q_u)
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
        result = verify_traversal(tokens, q, p, TorchRandom(seed=seed))
        assert 0 <= result.path < num_paths and 0 <= result.accepted_len <= block_len
        assert 0 <= result.next_token < vocab


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
