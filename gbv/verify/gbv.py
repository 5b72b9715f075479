"""Greedy Multi-Path Block Verification, GBV (Thomas & Pal, 2026). SPEC section 3.

GBV picks one of the K i.i.d. drafted paths by a fixed, greedy, tree-based ranking of all length-L
sequences, and then runs block verification (BV, :func:`gbv.verify.block.block_verify_path`) on that
path with the draft law ``q`` replaced by the exact law ``q_G`` of the *selected* path (the "skewed
draft"). BV is lossless for any draft law it is told exactly, so GBV is lossless; the selection makes
the verified path look more like the target, which usually (not on every instance) raises the
accepted length as K grows.

Pipeline (shapes for one sequence; K paths, block length L, vocabulary V):

1. :func:`ranking_key` -- the one function that orders tokens at a node: the ratio ``p(x) / q(x)``
   (larger is better). Selection and ``q_G`` both use it, on the very same numbers; ties are broken
   by the smaller token id in both places.
2. :func:`select_path` -- ``(K, L)`` tokens, ``(K, L, V)`` q, ``(K, L+1, V)`` p -> index of the
   highest-ranked path (lexicographic comparison, candidate filtering depth by depth).
3. :func:`skewed_draft_law` -- ``(L,)`` selected tokens, ``(L, V)`` q and ``(L+1, V)`` p along that
   path -> ``(L, V)`` float64 conditionals ``q_G`` of the selected path, in the stable form of SPEC
   section 3, vectorised over the vocabulary (one batched sort over all L nodes).
4. :func:`verify_gbv` -- BV on the selected path with ``p`` and ``q_G``.

Precision: ranking keys are computed in the inputs' precision (float32, or float64 for float64
inputs); ``q_G`` is computed in float64 whatever the input dtype (float32 inputs are converted
exactly), and BV then runs in float64 on the selected path (``q_G`` and ``p`` as float64).
``K = 1`` gives ``q_G = q`` exactly, and BV then runs on the inputs as given: GBV with one path is BV,
bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from gbv.verify.block import block_verify_path
from gbv.verify.common import RandomSource, VerifyResult, check_shapes

# Key of tokens with p(x) = q(x) = 0: below every real ratio (ratios are >= 0). Such tokens carry no
# q-mass, so where they sit changes neither q_G nor any drafted path's rank; the value only makes the
# order total and deterministic (and avoids computing 0/0).
ZERO_ZERO_KEY = -1.0

# On CPU, vocabularies larger than this are sorted with numpy (several times faster than torch's
# stable sort for V ~ 1e5); both give the same order.
_NUMPY_SORT_MIN_VOCAB = 2048


def ranking_key(p: Tensor, q: Tensor) -> Tensor:
    """Per-token ranking key at a node, elementwise: larger = better. Any shape in, same shape out.

    ``p / q`` where ``q > 0``; ``+inf`` where ``q = 0 < p`` (the draft can never propose it, the target
    wants it); :data:`ZERO_ZERO_KEY` where ``p = q = 0``. Ties (equal keys) are broken by the smaller
    token id by the callers. Computed in float64 when an input is float64, else in float32 (the
    precision of the inputs; any fixed ranking keeps GBV lossless, and float32 keys sort faster).
    Why one function: the losslessness proof needs ``q_G`` to be the law of the path that
    :func:`select_path` picks, so both must see bit-identical keys; being elementwise, the key of a
    token does not depend on which other tokens it is computed with.
    """
    dtype = torch.float64 if torch.float64 in (p.dtype, q.dtype) else torch.float32
    p = p.to(dtype)
    q = q.to(dtype)
    positive = q > 0
    ratio = p / torch.where(positive, q, 1.0)  # never 0/0
    if bool(positive.all()):
        return ratio
    special = torch.where(p > 0, math.inf, ZERO_ZERO_KEY).to(dtype)
    return torch.where(positive, ratio, special)


def select_path(draft_tokens: Tensor, q: Tensor, p: Tensor) -> int:
    """Index of the highest-ranked of the K drafted paths (SPEC section 3, "Selection").

    Args:
        draft_tokens: (K, L) long.
        q: (K, L, V) draft distributions; p: (K, L+1, V) target distributions.
    Returns:
        The smallest index among the paths equal to the best sequence.

    Why candidate filtering works: candidates alive at depth ``d`` share the prefix ``s_{1:d}``, so
    their tokens at ``d`` sit at the same node and their keys are comparable; the first depth where
    two paths differ decides the lexicographic order. Each candidate's key is read from its own rows
    (``p[k, d]``, ``q[k, d]`` at its own token, where ``q > 0`` because the token was drawn from it); for
    a shared prefix these rows are the same node's, so this is the node's ranking, and it needs no
    division by zero even when ``p`` and ``q`` are one-hot (temperature 0).
    """
    num_paths, block_len = draft_tokens.shape
    alive = torch.arange(num_paths, device=draft_tokens.device)
    for depth in range(block_len):
        if alive.numel() == 1:
            break
        toks = draft_tokens[alive, depth]
        keys = ranking_key(p[alive, depth, toks], q[alive, depth, toks])
        best_tok = toks[keys == keys.max()].min()  # best key, ties -> smaller token id
        alive = alive[toks == best_tok]
    return int(alive[0])


def _rank_order(p_path: Tensor, q_path: Tensor) -> Tensor:
    """(L, V) p and q rows of the nodes on a path -> (L, V) token ids, best first, per node.

    Sorted by :func:`ranking_key` descending, ties by smaller token id -- the order
    :func:`select_path` uses. The result equals ``torch.sort(-key, stable=True).indices``; on CPU it is
    computed with numpy (see :func:`_stable_argsort_rows`) when the vocabulary is large (for tiny
    ones the per-call overhead dominates and torch's sort is used).
    """
    neg_key = -ranking_key(p_path, q_path)
    if neg_key.device.type != "cpu" or not _NUMPY_SORT_MIN_VOCAB < neg_key.shape[-1] < 2**31:
        return torch.sort(neg_key, dim=-1, stable=True).indices
    return torch.from_numpy(_stable_argsort_rows(neg_key.numpy()))


def _stable_argsort_rows(keys: np.ndarray) -> np.ndarray:
    """Row-wise ascending argsort with ties in increasing index order, for a 2-D float array.

    float32 keys: one sort of the int64 values ``(sortable bits of the key) * 2^32 + index``, which are
    distinct, so numpy's fast unstable sort gives exactly the stable order. Other dtypes: numpy's
    default argsort (much faster than a stable sort, ties in arbitrary order), then the tied runs
    (few for real-valued ratios; whole rows when p = q) are put in index order by sorting their
    entries, listed row-major so each run is contiguous, by ``run_id * V + index``, exact in int64.
    """
    vocab = keys.shape[-1]
    if keys.dtype == np.float32:
        bits = (keys + np.float32(0.0)).view(np.int32)  # + 0.0 maps -0.0 to +0.0 (equal keys, equal bits)
        bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order of these = float order
        packed = (bits.astype(np.int64) << 32) | np.arange(vocab, dtype=np.int64)
        packed.sort(axis=-1)
        return packed & 0xFFFFFFFF
    order = np.argsort(keys, axis=-1)
    sorted_keys = np.take_along_axis(keys, order, axis=-1)
    same_as_prev = np.zeros(keys.shape, dtype=bool)
    np.equal(sorted_keys[:, 1:], sorted_keys[:, :-1], out=same_as_prev[:, 1:])
    if not same_as_prev.any():
        return order
    in_run = same_as_prev.copy()
    in_run[:, :-1] |= same_as_prev[:, 1:]
    rows, cols = np.nonzero(in_run)
    run_id = np.cumsum(~same_as_prev[rows, cols])
    order[rows, cols] = np.sort(run_id * vocab + order[rows, cols]) % vocab
    return order


def _power_sum(x: Tensor, z: Tensor, num_paths: int) -> Tensor:
    """``S(x, z) = sum_{j=0}^{K-1} x^j z^(K-1-j)`` elementwise (same shapes), for ``x, z`` in [0, 1].

    Horner-like recurrence ``S_1 = 1``, ``S_{n+1} = z S_n + x^n`` (in place): only sums of non-negative
    terms, so no cancellation, and every term is at most 1 (no overflow for any K).
    """
    total = torch.ones_like(x)
    x_pow = torch.ones_like(total)
    for _ in range(num_paths - 1):
        x_pow.mul_(x)
        total.mul_(z).add_(x_pow)
    return total


def skewed_draft_law(selected_tokens: Tensor, q_path: Tensor, p_path: Tensor, num_paths: int) -> Tensor:
    """Conditionals ``q_G`` of the selected path's law along that path (SPEC section 3).

    Args:
        selected_tokens: (L,) the selected path ``s``.
        q_path: (L, V) draft rows at the nodes ``s_{1:i}``, ``i = 0..L-1``.
        p_path: (L+1, V) target rows along the path (only the first L are used: they rank tokens).
        num_paths: K, the number of i.i.d. drafted paths the selection chose from.
    Returns:
        (L, V) float64: ``q_G[i, y]`` = probability that the selected path continues ``s_{1:i}`` with
        ``y``, given that it starts with ``s_{1:i}``. ``K = 1`` returns ``q`` (as float64) exactly.

    Why this formula: with ``m`` the q-mass of a prefix block and ``A`` that of the block plus all
    sequences ranked below it, ``P(selected starts with the block) = A^K - (A - m)^K``. Dividing by
    ``A^K`` of the parent block turns the difference of K-th powers into ``v q(y) S(x, z)`` with
    ``x = 1 - v b(y)``, ``z = 1 - v (b(y) + q(y))`` and ``v = m / A`` of the current node, which has no
    cancellation. We carry both ``v`` and ``u = 1 - v`` and write ``x = u + v a(y)``, ``z = u + v c(y)``
    with ``c(y)`` the q-mass ranked strictly *below* ``y`` and ``a(y) = c(y) + q(y)``: sums of
    non-negative terms only, so accurate even when ``b(y)`` is within rounding of 1 (tiny
    probabilities, long blocks). In worst-first order ``a`` is a plain cumulative sum and ``z`` of a
    token is ``x`` of the next-worse one.
    """
    block_len, vocab = q_path.shape
    q64 = q_path.to(torch.float64)
    if num_paths == 1:
        return q64.clone()  # S = 1: the selected path is the only path, q_G = q exactly
    # 1. Per node, order tokens worst first (the reverse of select_path's ranking).
    order = _rank_order(p_path[:block_len], q_path).flip(-1)
    q_sorted = q64.gather(-1, order)
    at_or_below = q_sorted.cumsum(-1)  # a(y) = q-mass of y and of everything ranked below it
    # 2. The scalar walk down the path: v (normalised q-mass of the current block) and u = 1 - v.
    tokens = selected_tokens.reshape(block_len, 1).to(order.device)
    pos = (order == tokens).nonzero()[:, 1:]  # (L, 1) rank of s_{i+1}, worst first
    a_on = at_or_below.gather(-1, pos).squeeze(-1).tolist()
    c_on = torch.where(pos > 0, at_or_below.gather(-1, (pos - 1).clamp_min(0)), 0.0).squeeze(-1).tolist()
    q_on = q64.gather(-1, tokens).squeeze(-1).tolist()
    v_list, u_list = [], []
    v, u = 1.0, 0.0
    for i in range(block_len):
        v_list.append(v)
        u_list.append(u)
        x_on = u + v * a_on[i]  # = 1 - v b(s_{i+1})
        if x_on > 0.0:
            v, u = v * q_on[i] / x_on, (u + v * c_on[i]) / x_on
        else:  # s_{i+1} has q-probability 0 (not a real draft): any v in [0, 1] keeps rows normalised
            v, u = 0.0, 1.0
    v_col = torch.tensor(v_list, dtype=torch.float64, device=q64.device).unsqueeze(-1)
    u_col = torch.tensor(u_list, dtype=torch.float64, device=q64.device).unsqueeze(-1)
    # 3. q_G(y) = q(y) S(x(y), z(y)) / S(0, v), all nodes and tokens at once; S(0, v) = sum_j u^j >= 1.
    x = torch.addcmul(u_col, v_col, at_or_below)
    z = torch.cat([u_col, x[:, :-1]], dim=-1)
    denom = _power_sum(torch.ones_like(u_col), u_col, num_paths)
    q_g_sorted = _power_sum(x, z, num_paths).mul_(q_sorted).div_(denom)
    return torch.zeros_like(q64).scatter_(-1, order, q_g_sorted)


def verify_gbv(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """GBV: (K, L) long tokens, (K, L, V) q, (K, L+1, V) p -> :class:`VerifyResult`.

    Select the highest-ranked path, compute the law ``q_G`` of the selected path along it, and run BV
    on it with ``p`` and ``q_G`` (weights, residual masses and the residual all use ``q_G``), in float64.
    Returns the selected path's index, the accepted length and the next token. With ``K = 1``,
    ``q_G = q`` and BV runs on the inputs as given, so the result is exactly BV's. Temperature 0
    (one-hot ``p`` and ``q``) reduces to the longest drafted prefix matching the target's argmax,
    then its argmax.
    """
    num_paths, _, _ = check_shapes(draft_tokens, q, p)
    path = select_path(draft_tokens, q, p)
    tokens = draft_tokens[path]
    if num_paths == 1:
        q_g, p_path = q[path], p[path]
    else:
        q_g, p_path = skewed_draft_law(tokens, q[path], p[path], num_paths), p[path].to(torch.float64)
    accepted_len, next_token = block_verify_path(tokens, q_g, p_path, rng)
    return VerifyResult(path, accepted_len, next_token)
