"""SpecInfer, recursive rejection sampling with replacement (SPEC section 4).

Exact losslessness by enumeration (:func:`gbv.theory.exact_analysis` replays every branch of the very
verifier code), SPEC section 10 values, temperature 0 (SPEC section 8), and a negative control:
skipping duplicate draws must be caught by the same exact check.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from gbv.theory import context_free_instance, enumerate_branches, exact_analysis, random_instance
from gbv.theory.instance import TinyInstance
from gbv.verify import TorchRandom, get_verifier
from gbv.verify import specinfer
from gbv.verify.specinfer import verify_specinfer
from gbv.verify.token import verify_token

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
    assert exact_analysis(verify_specinfer, inst).max_law_error < LOSSLESS_TOL


@pytest.mark.parametrize("vocab,block_len,num_paths,kind", FAST)
def test_lossless_exact(vocab, block_len, num_paths, kind):
    _lossless(vocab, block_len, num_paths, kind)


@pytest.mark.slow
@pytest.mark.parametrize("vocab,block_len,num_paths,kind", SLOW)
def test_lossless_exact_large(vocab, block_len, num_paths, kind):
    _lossless(vocab, block_len, num_paths, kind)


@pytest.mark.parametrize("num_paths,expected", [(1, 10 / 9), (2, 4 / 3), (3, 1087 / 729)])
def test_spec_reference_values(num_paths, expected):
    inst = context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2, num_paths)
    result = exact_analysis(verify_specinfer, inst)
    assert result.expected_accepted == pytest.approx(expected, abs=1e-12)
    assert result.max_law_error < 1e-12


@pytest.mark.parametrize("vocab,block_len,seed", [(3, 2, 0), (4, 3, 1), (2, 3, 2)])
def test_single_path_is_token_level(vocab, block_len, seed):
    inst = random_instance(vocab, block_len, 1, seed, "mixed")
    ours, ref = exact_analysis(verify_specinfer, inst), exact_analysis(verify_token, inst)
    assert ours.expected_accepted == pytest.approx(ref.expected_accepted, abs=1e-12)
    for out in set(ours.emitted_law) | set(ref.emitted_law):
        assert ours.emitted_law.get(out, 0.0) == pytest.approx(ref.emitted_law.get(out, 0.0), abs=1e-12)


def test_registry():
    assert get_verifier("specinfer") is verify_specinfer


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
    assert _check_greedy(verify_specinfer, greedy) >= 1


@pytest.mark.parametrize("kind", ["mixed", "sharp", "truncated"])
def test_greedy_target_sampled_draft(kind):
    """One-hot p, stochastic q (paths differ): still the longest matching prefix over all paths."""
    base = random_instance(3, 2, 3, 7, kind)
    inst = TinyInstance(3, 2, 3, _one_hot(base.target), base.draft)
    assert _check_greedy(verify_specinfer, inst) >= 1


# ---------------------------------------------------------------------- negative control
NEGATIVE_INSTANCES = [(3, 1, 2, 0), (3, 1, 2, 1), (4, 1, 3, 0), (3, 2, 2, 0)]


def _max_error_on_negative_set() -> float:
    return max(exact_analysis(verify_specinfer, random_instance(v, l, k, s, "dirichlet")).max_law_error
               for v, l, k, s in NEGATIVE_INSTANCES)


def test_negative_control_set_is_lossless_unpatched():
    assert _max_error_on_negative_set() < LOSSLESS_TOL


def test_skipping_duplicate_draws_is_caught(monkeypatch):
    def first_copy_only(alive, level_tokens):
        seen, order = set(), []
        for k in alive:
            if level_tokens[k] not in seen:
                seen.add(level_tokens[k])
                order.append(k)
        return order

    monkeypatch.setattr(specinfer, "_trial_order", first_copy_only)
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
        result = verify_specinfer(tokens, q, p, TorchRandom(seed=seed))
        assert 0 <= result.path < num_paths and 0 <= result.accepted_len <= block_len
        assert 0 <= result.next_token < vocab
