"""Block verification, BV (Sun et al., ICLR 2025), one path. SPEC section 2.

BV decides the accepted length jointly for the whole block instead of token by token, which is
optimal for a single path. :func:`block_verify_path` is also the last step of GBV
(:mod:`gbv.verify.gbv`), which calls it with the skewed draft law ``q_G`` of the selected path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gbv.verify.common import RandomSource, VerifyResult, check_shapes, on_path_probs, residual


def block_verify_path(tokens: Tensor, q_path: Tensor, p_path: Tensor, rng: RandomSource) -> tuple[int, int]:
    """BV on one path.

    Args:
        tokens: (L,) drafted tokens.
        q_path: (L, V) the law each token was drawn from, given the path so far.
        p_path: (L+1, V) target distributions along the path.
    Returns:
        ``(accepted_len, next_token)``.
    """
    block_len = tokens.shape[0]
    ratios = (on_path_probs(p_path[:block_len], tokens) / on_path_probs(q_path, tokens)).tolist()
    # w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i)), w_0 = 1.
    weights = [1.0]
    for ratio in ratios:
        weights.append(min(1.0, weights[-1] * ratio))
    w = torch.tensor(weights, dtype=p_path.dtype, device=p_path.device)
    # Residual mass r_i = sum_x (w_i p_i(x) - q_i(x))+ for 1 <= i < L, all positions at once.
    r = (w[1:block_len, None] * p_path[1:block_len] - q_path[1:block_len]).clamp_min(0.0).sum(-1).tolist()
    stop_probs = [0.0] * (block_len + 1)  # h_i, index i = 1..L
    stop_probs[block_len] = weights[block_len]
    for i in range(1, block_len):
        # r + (1 - w), not r + 1 - w: with w = 1 this gives exactly r / r = 1 (no 1 - 2e-16 branch).
        denom = r[i - 1] + (1.0 - weights[i])
        stop_probs[i] = 1.0 if denom <= 0.0 else r[i - 1] / denom
    accepted_len = 0
    for i in range(block_len, 0, -1):
        if rng.accept(stop_probs[i]):
            accepted_len = i
            break
    if accepted_len == block_len:
        return accepted_len, rng.sample(p_path[block_len])
    return accepted_len, rng.sample(residual(p_path[accepted_len], q_path[accepted_len], weights[accepted_len]))


def verify_block(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """(K, L) tokens, (K, L, V) q, (K, L+1, V) p -> BV result on path 0."""
    check_shapes(draft_tokens, q, p)
    accepted_len, next_token = block_verify_path(draft_tokens[0], q[0], p[0], rng)
    return VerifyResult(0, accepted_len, next_token)
