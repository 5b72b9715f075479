"""Block verification, BV (Sun et al., ICLR 2025), one path. SPEC section 2.

BV decides the accepted length jointly for the whole block instead of token by token, which is
optimal for a single path. :func:`block_verify_path` is also the last step of GBV
(:mod:`gbv.verify.gbv`), which calls it with the skewed draft law ``q_G`` of the selected path.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from gbv.verify.common import RandomSource, VerifyResult, check_shapes, on_path_probs, residual


# residual_masses(rows, weights) -> r_i = sum_x (w_i p_i(x) - q_i(x))+ for the given nodes i (1 <= i < L).
ResidualMasses = Callable[[list[int], list[float]], list[float]]
# residual_dist(i, w_i) -> (V,) norm((w_i p_i - q_i)+), the correction distribution at node i < L.
ResidualDist = Callable[[int, float], Tensor]


def block_verify_core(ratios: list[float], residual_masses: ResidualMasses, residual_dist: ResidualDist,
                      bonus: Tensor, rng: RandomSource) -> tuple[int, int]:
    """BV (SPEC section 2) given only what it needs of the rows.

    Args:
        ratios: ``p_{i-1}(x_i) / q_{i-1}(x_i)`` for ``i = 1..L`` (on-path values only).
        residual_masses: the residual masses ``r_i`` of the nodes where the weight is below 1 (asked
            once, for all of them together; where ``w_i = 1``, ``h_i = 1`` whatever ``r_i`` is).
        residual_dist: the correction distribution at the accepted length, asked at most once.
        bonus: (V,) ``p_L``, sampled when the whole block is accepted.
    Returns:
        ``(accepted_len, next_token)``.
    """
    block_len = len(ratios)
    # w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i)), w_0 = 1.
    weights = [1.0]
    for ratio in ratios:
        weights.append(min(1.0, weights[-1] * ratio))
    needed = [i for i in range(1, block_len) if weights[i] < 1.0]
    r = dict(zip(needed, residual_masses(needed, [weights[i] for i in needed]))) if needed else {}
    stop_probs = [1.0] * (block_len + 1)  # h_i, index i = 1..L
    stop_probs[block_len] = weights[block_len]
    for i in needed:
        # r + (1 - w), not r + 1 - w: with w = 1 this gives exactly r / r = 1 (no 1 - 2e-16 branch).
        denom = r[i] + (1.0 - weights[i])
        stop_probs[i] = 1.0 if denom <= 0.0 else r[i] / denom
    accepted_len = 0
    for i in range(block_len, 0, -1):
        if rng.accept(stop_probs[i]):
            accepted_len = i
            break
    if accepted_len == block_len:
        return accepted_len, rng.sample(bonus)
    return accepted_len, rng.sample(residual_dist(accepted_len, weights[accepted_len]))


def block_verify_path(tokens: Tensor, q_path: Tensor, p_path: Tensor, rng: RandomSource) -> tuple[int, int]:
    """BV on one path, with full rows.

    Args:
        tokens: (L,) drafted tokens.
        q_path: (L, V) the law each token was drawn from, given the path so far.
        p_path: (L+1, V) target distributions along the path.
    Returns:
        ``(accepted_len, next_token)``.
    """
    block_len = tokens.shape[0]
    ratios = (on_path_probs(p_path[:block_len], tokens) / on_path_probs(q_path, tokens)).tolist()

    def residual_masses(rows: list[int], weights: list[float]) -> list[float]:
        w = torch.tensor(weights, dtype=p_path.dtype, device=p_path.device).unsqueeze(-1)
        return (w * p_path[rows] - q_path[rows]).clamp_min(0.0).sum(-1).tolist()

    return block_verify_core(ratios, residual_masses,
                             lambda i, w: residual(p_path[i], q_path[i], w), p_path[block_len], rng)


def verify_block(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """(K, L) tokens, (K, L, V) q, (K, L+1, V) p -> BV result on path 0."""
    check_shapes(draft_tokens, q, p)
    accepted_len, next_token = block_verify_path(draft_tokens[0], q[0], p[0], rng)
    return VerifyResult(0, accepted_len, next_token)
