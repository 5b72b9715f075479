"""Exact checks shared by the verifier tests in this folder (a plain module, put on ``sys.path`` by
``conftest.py`` like ``tests/engine/engine_toy.py``).

SpecInfer, SpecTr and Traversal Verification are held to the very same exact checks: losslessness by
enumeration on one grid of instances and seeds, temperature 0 (SPEC section 8), a negative-control
set, a large-vocabulary smoke run. Written once, the checks cannot drift apart between verifiers,
and a stricter check or a new instance reaches all of them. Each verifier's file keeps what is its
own (SPEC section 10 values, the single-path method it reduces to, the internals its negative
controls break) and brings in the shared tests by name::

    from exact_checks import test_temperature_zero, ...  # collected in that file, ids unchanged
    verifier = verifier_fixture(verify_specinfer)  # what those tests run on

The building blocks (draft-tuple tensors, one-hot tables, the greedy check) also serve
test_gbv.py and the all-methods master tests in test_lossless.py.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
import pytest
import torch

from gbv.theory import context_free_instance, enumerate_branches, exact_analysis, random_instance
from gbv.theory.instance import TinyInstance
from gbv.verify import TorchRandom
from gbv.verify.common import Verifier
from gbv.verify.token import verify_token

KINDS = ("mixed", "truncated", "equal", "sharp")
# Exact enumeration in float64: a lossless verifier is off by rounding only, far below this bound.
LOSSLESS_TOL = 1e-9

# (V, L, K) with V^(L*K) draft tuples: up to 256 in the fast set; the largest sizes go to the slow set.
SIZES = [(v, l, k) for v in (2, 3, 4) for l in (1, 2, 3) for k in (1, 2, 3)]
FAST = [(v, l, k, kind) for v, l, k in SIZES if v ** (l * k) <= 256 for kind in KINDS]
FAST += [(v, l, k, "mixed") for v, l, k in SIZES if 256 < v ** (l * k) <= 729]
SLOW = [(v, l, k, kind) for v, l, k in SIZES if 256 < v ** (l * k) <= 729 for kind in KINDS if kind != "mixed"]
# The 4096-tuple shapes cost ~10 s each: one mixed instance (rows of every kind) per shape.
SLOW += [(v, l, k, "mixed") for v, l, k in SIZES if 729 < v ** (l * k) <= 4096]

# The multi-path grid points up to 256 draft tuples, for the device forms: they draw every coin of
# a level (or node) at once, so the enumerator branches on coins the host forms never reach and a
# 729-tuple point costs 15-76 s; the host forms cover those points in test_lossless.py.
DEVICE_GRID = [point for point in FAST if point[2] > 1 and point[0] ** (point[1] * point[2]) <= 256]
# Small enough that the greedy check can visit every branch of every draft tuple.
GREEDY_CASES = [(3, 2, 3, 0), (2, 3, 2, 1), (4, 1, 3, 2), (4, 3, 1, 3)]
# (V, L, K, seed) of the negative-control set: tiny, yet each verifier's planted bugs show on it.
NEGATIVE_INSTANCES = [(3, 1, 2, 0), (3, 1, 2, 1), (4, 1, 3, 0), (3, 2, 2, 0)]


def grid_seed(vocab: int, block_len: int, num_paths: int, kind: str) -> int:
    """One fixed seed per grid point, so every verifier is checked on the very same instances."""
    return 1000 * vocab + 100 * block_len + 10 * num_paths + KINDS.index(kind)


# ---------------------------------------------------------------------- building blocks
def coarse_buckets(monkeypatch) -> None:
    """Bucket every vocabulary, in buckets of a key ratio up to 2^16 (3 exponent bits), so that tiny
    instances have several tokens per bucket: the large-vocabulary code paths of gbv.verify.ranking
    (bucketed ranks, unsettled buckets, bounds that differ from the exact masses) run on instances
    small enough to enumerate."""
    from gbv.verify import ranking

    monkeypatch.setattr(ranking, "BUCKET_MIN_VOCAB", 0)
    monkeypatch.setattr(ranking, "_BUCKET_SHIFT", 27)
    monkeypatch.setattr(ranking, "_NUM_BUCKETS", (0x7F800000 >> 27) + 1)


def path_tensors(inst: TinyInstance, seq: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, V) draft and (L+1, V) target rows along one drafted sequence (fresh copies: a verifier
    that wrote into its inputs could not corrupt the instance's tables)."""
    q = torch.tensor(np.stack([inst.draft[seq[:i]] for i in range(inst.block_len)]))
    p = torch.tensor(np.stack([inst.target[seq[:i]] for i in range(inst.block_len + 1)]))
    return q, p


def tuple_inputs(inst: TinyInstance, paths) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verifier's inputs for one tuple of drafted paths: tokens (K, L), q (K, L, V), p (K, L+1, V)."""
    tensors = [path_tensors(inst, s) for s in paths]
    draft_tokens = torch.tensor(paths, dtype=torch.long).reshape(len(paths), inst.block_len)
    return draft_tokens, torch.stack([t[0] for t in tensors]), torch.stack([t[1] for t in tensors])


def one_hot_table(table: dict, pick: Callable[[np.ndarray], int]) -> dict:
    """``table`` (context -> row) with every row replaced by a one-hot row at ``pick(row)``
    (rows visited in the table's order, so a random ``pick`` is reproducible)."""
    out = {}
    for ctx, row in table.items():
        hot = np.zeros_like(row)
        hot[pick(row)] = 1.0
        out[ctx] = hot
    return out


def argmax_one_hot(table: dict) -> dict:
    """The table at temperature 0: each row one-hot at its argmax."""
    return one_hot_table(table, lambda row: int(np.argmax(row)))


def check_greedy(verifier: Verifier, inst: TinyInstance, num_paths: int | None = None) -> int:
    """SPEC section 8 on every branch of every tuple of ``num_paths`` (default K) drafted paths: the
    verifier accepts the longest drafted prefix that matches the target's argmax chain (over all
    the paths it is given), on a path that matches that far, then emits the argmax. Returns the
    number of branches checked."""
    num_paths = num_paths or inst.num_paths
    length = inst.block_len
    argmax = {ctx: int(np.argmax(row)) for ctx, row in inst.target.items()}

    def matched(seq):
        m = 0
        while m < length and argmax[seq[:m]] == seq[m]:
            m += 1
        return m

    seqs = [s for s in itertools.product(range(inst.vocab), repeat=length) if inst.seq_prob(inst.draft, s) > 0]
    checked = 0
    for combo in itertools.product(seqs, repeat=num_paths):
        best = max(matched(s) for s in combo)
        for result, _ in enumerate_branches(verifier, *tuple_inputs(inst, combo)):
            seq = combo[result.path]
            assert result.accepted_len == best and matched(seq) >= best, (combo, result, best)
            assert result.next_token == argmax[seq[:best]], (combo, result, best)
            checked += 1
    return checked


# ---------------------------------------------------------------------- checks with per-verifier values
def check_reference_value(verifier: Verifier, num_paths: int, expected: float, tol: float,
                          inst: TinyInstance | None = None) -> None:
    """SPEC section 10: E[tau] on the context-free instance p = (1/3, 2/3), q = (2/3, 1/3), L = 2
    (or on ``inst``), and lossless to 1e-12."""
    inst = inst or context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], 2, num_paths)
    result = exact_analysis(verifier, inst)
    assert result.expected_accepted == pytest.approx(expected, abs=tol)
    assert result.max_law_error < 1e-12


def check_same_law(verifier: Verifier, reference: Verifier, inst: TinyInstance) -> None:
    """``verifier`` has the law of ``reference`` on ``inst``: the same E[tau] and emitted-token law."""
    ours, ref = exact_analysis(verifier, inst), exact_analysis(reference, inst)
    assert ours.expected_accepted == pytest.approx(ref.expected_accepted, abs=1e-12)
    for out in set(ours.emitted_law) | set(ref.emitted_law):
        assert ours.emitted_law.get(out, 0.0) == pytest.approx(ref.emitted_law.get(out, 0.0), abs=1e-12)


def check_device_form(device: Verifier, host: Verifier, vocab: int, block_len: int, num_paths: int, kind: str,
                      expected_tol: float = 1e-12) -> None:
    """A device form on one grid point (``grid_seed``'s instance): lossless, and its E[tau] that of
    its host form to ``expected_tol``."""
    inst = random_instance(vocab, block_len, num_paths, seed=grid_seed(vocab, block_len, num_paths, kind), kind=kind)
    result = exact_analysis(device, inst)
    assert result.max_law_error < LOSSLESS_TOL
    assert abs(result.expected_accepted - exact_analysis(host, inst).expected_accepted) < expected_tol


def check_same_outcome_laws(verifier: Verifier, reference: Verifier, inst: TinyInstance, tuples: int,
                            tol: float) -> None:
    """For the first ``tuples`` K-tuples of drafted paths (of positive draft probability), the law of
    ``(path, accepted_len, next_token)`` of ``verifier`` equals ``reference``'s to ``tol``: forms that
    consume their randomness differently can only be compared by their laws."""
    seqs = [s for s in itertools.product(range(inst.vocab), repeat=inst.block_len) if inst.seq_prob(inst.draft, s) > 0]
    for paths in itertools.islice(itertools.product(seqs, repeat=inst.num_paths), tuples):
        inputs = tuple_inputs(inst, list(paths))
        ours, ref = outcome_law(verifier, *inputs), outcome_law(reference, *inputs)
        assert all(abs(ours.get(k, 0.0) - ref.get(k, 0.0)) < tol for k in set(ours) | set(ref)), paths


def check_reads_the_host_once(verifier: Verifier) -> None:
    """Seeded float32 calls (the engine's dtype) of a device form give a result in range and read the
    host once each."""
    from gbv.bench.host_reads import count_host_reads, verify_inputs
    from gbv.verify import TorchRandom

    rng = TorchRandom(seed=0)
    for seed in range(5):
        tokens, q, p = verify_inputs(3, seed=seed)
        with count_host_reads() as reads:
            result = verifier(tokens, q, p, rng)
        assert reads["n"] == 1
        assert 0 <= result.path < 3 and 0 <= result.accepted_len <= tokens.shape[1]
        assert 0 <= result.next_token < p.shape[-1]


def max_error_on_negative_set(verifier: Verifier) -> float:
    """Largest law error over NEGATIVE_INSTANCES: below LOSSLESS_TOL for the real verifier, and a
    planted bug must push it above 1e-6, or the exact check would not be worth trusting."""
    return max(exact_analysis(verifier, random_instance(v, l, k, s, "dirichlet")).max_law_error
               for v, l, k, s in NEGATIVE_INSTANCES)


# ---------------------------------------------------------------------- shared tests (need a `verifier` fixture)
def verifier_fixture(verifier: Verifier):
    """The ``verifier`` fixture the shared tests below take; a test file binds it to its verifier with
    ``verifier = verifier_fixture(verify_x)`` (pytest finds fixtures by the module attribute)."""
    @pytest.fixture(name="verifier")
    def _verifier() -> Verifier:
        return verifier
    return _verifier


@pytest.mark.parametrize("vocab,block_len,seed", [(3, 2, 0), (4, 3, 1), (2, 3, 2)])
def test_single_path_is_token_level(verifier, vocab, block_len, seed):
    """For verifiers that reduce to token-level sampling with one path (SpecInfer, SpecTr)."""
    check_same_law(verifier, verify_token, random_instance(vocab, block_len, 1, seed, "mixed"))


@pytest.mark.parametrize("vocab,block_len,num_paths,seed", GREEDY_CASES)
def test_temperature_zero(verifier, vocab, block_len, num_paths, seed):
    base = random_instance(vocab, block_len, num_paths, seed, "mixed")
    greedy = TinyInstance(vocab, block_len, num_paths, argmax_one_hot(base.target), argmax_one_hot(base.draft))
    assert check_greedy(verifier, greedy) >= 1


@pytest.mark.parametrize("kind", ["mixed", "sharp", "truncated"])
def test_greedy_target_sampled_draft(verifier, kind):
    """One-hot p, stochastic q (paths differ): still the longest matching prefix over all paths."""
    base = random_instance(3, 2, 3, 7, kind)
    inst = TinyInstance(3, 2, 3, argmax_one_hot(base.target), base.draft)
    assert check_greedy(verifier, inst) >= 1


def test_negative_control_set_is_lossless_unpatched(verifier):
    assert max_error_on_negative_set(verifier) < LOSSLESS_TOL


def embed(inst: TinyInstance, paths, vocab: int, ids: list[int], dtype: torch.dtype):
    """The inputs of ``tuple_inputs(inst, paths)`` embedded in a vocabulary of size ``vocab``: token ``t``
    of the tiny instance becomes ``ids[t]`` (increasing, so the tie-break by id is kept) and every other
    token has ``p = q = 0``."""
    tokens, q, p = tuple_inputs(inst, paths)
    index = torch.tensor(ids)
    q_big = torch.zeros(*q.shape[:2], vocab, dtype=dtype).index_copy_(-1, index, q.to(dtype))
    p_big = torch.zeros(*p.shape[:2], vocab, dtype=dtype).index_copy_(-1, index, p.to(dtype))
    return index[tokens], q_big, p_big


def embedded_law_gap(verifier: Verifier, inst: TinyInstance, paths, vocab: int, ids: list[int],
                     dtype: torch.dtype) -> float:
    """The largest difference between the outcome laws of one tuple of drafted paths on ``inst`` and on
    its embedding at ``vocab`` tokens in ``dtype`` (:func:`embed`)."""
    small = outcome_law(verifier, *tuple_inputs(inst, paths))
    big = outcome_law(verifier, *embed(inst, paths, vocab, ids, dtype), token_map={v: k for k, v in enumerate(ids)})
    return max((abs(big.get(k, 0.0) - small.get(k, 0.0)) for k in set(big) | set(small)), default=0.0)


def outcome_law(verifier: Verifier, tokens, q, p, token_map=None) -> dict[tuple[int, int, int], float]:
    """Law of ``(path, accepted_len, next_token)`` over every random branch (``token_map`` renames tokens)."""
    law: dict[tuple[int, int, int], float] = {}
    for result, prob in enumerate_branches(verifier, tokens, q, p):
        key = (result.path, result.accepted_len, token_map[result.next_token] if token_map else result.next_token)
        law[key] = law.get(key, 0.0) + prob
    return {k: v for k, v in law.items() if v > 1e-15}


def test_large_vocab_embeds_tiny(verifier):
    """A large vocabulary (V = 8192: above the numpy-sort and bucket thresholds) gives the law of the
    tiny instance it embeds: the large-vocabulary code paths (numpy sorts, bucketed masses,
    support-only ranking) are exact. In float32 (rows no longer sum to 1 within the enumerator's
    1e-9) seeded production runs only give outcomes that are possible in the float64 law."""
    inst = random_instance(3, 2, 3, 11, "mixed")
    vocab, ids = 8192, [17, 4000, 8191]
    to_small = {v: k for k, v in enumerate(ids)}
    rng = np.random.default_rng(0)
    seqs = [s for s in itertools.product(range(3), repeat=2) if inst.seq_prob(inst.draft, s) > 0]
    for _ in range(3):
        paths = [seqs[i] for i in rng.integers(len(seqs), size=3)]
        assert embedded_law_gap(verifier, inst, paths, vocab, ids, torch.float64) < 1e-12, paths
        small = outcome_law(verifier, *tuple_inputs(inst, paths))
        inputs32 = embed(inst, paths, vocab, ids, torch.float32)
        for seed in range(5):
            result = verifier(*inputs32, TorchRandom(seed=seed))
            assert (result.path, result.accepted_len, to_small[result.next_token]) in small, (paths, result)
