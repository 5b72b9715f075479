"""Token-level speculative sampling (Leviathan et al. 2023; Chen et al. 2023), one path. SPEC section 1.

Accept drafted token ``x_i`` with probability ``min(1, p(x_i) / q(x_i))``; at the first rejection emit
a token from ``norm((p - q)+)``; if all ``L`` are accepted emit a bonus token from ``p_L``.
Only path 0 is used when ``K > 1``.

Two forms of the same rule, as for BV (:mod:`gbv.verify.block`): :func:`token_verify_on_device`,
tensor code with one host read (off the CPU), and :func:`token_verify_host`, the sequential rule on
numpy views of the rows (the CPU's: a few numpy calls instead of ~40 small torch calls).
"""

from __future__ import annotations

from torch import Tensor

from gbv.verify.block import normalized_or, on_path_host, positive_part_and_sum, single_path_compiled
from gbv.verify.common import (RandomSource, VerifyResult, check_shapes, host_ints, on_path_probs, residual_on_device,
                               take_row, uses_device_form)


def token_verify_on_device(tokens: Tensor, q_path: Tensor, p_path: Tensor, rng: RandomSource) -> tuple[int, int]:
    """(L,) tokens, (L, V) q, (L+1, V) p -> ``(accepted_len, next_token)``. One host read.

    The L accept/reject decisions are drawn as independent coins at once; the accepted length is the
    number of leading accepted coins (coins after the first rejection are never looked at, so the
    law is that of the sequential rule).
    """
    block_len = tokens.shape[0]
    # Drafted tokens have q > 0, so the ratio is finite; a one-hot p (temperature 0) gives 0 or 1.
    accept_probs = (on_path_probs(p_path[:block_len], tokens) / on_path_probs(q_path, tokens)).clamp(max=1.0)
    accepted_len = rng.coins(accept_probs).long().cumprod(0).sum()
    # After a rejection at tau: norm((p_tau - q_tau)+); after a full block: p_L (q row zeroed).
    q_tau = take_row(q_path, accepted_len.clamp(max=block_len - 1)) * (accepted_len < block_len)
    next_token = rng.draw(residual_on_device(take_row(p_path, accepted_len), q_tau))
    tau, token = host_ints(accepted_len, next_token)
    return tau, token


def token_verify_host(tokens: Tensor, q_path: Tensor, p_path: Tensor, rng: RandomSource) -> tuple[int, int]:
    """The sequential rule on the host: one coin per drafted token until the first rejection, then a
    draw from ``norm((p - q)+)`` (float64), or from ``p_L`` after a full block; one compiled call
    where that runs (:func:`gbv.verify.block.single_path_compiled`). Shapes as
    :func:`token_verify_on_device`."""
    compiled = single_path_compiled(tokens, q_path, p_path, rng, False)
    if compiled is not None:
        return compiled
    block_len = tokens.shape[0]
    q_h, p_h, ratios = on_path_host(tokens, q_path, p_path)
    for i, ratio in enumerate(ratios):
        if not rng.accept(min(1.0, ratio)):
            row, total = positive_part_and_sum(p_h[i], q_h[i], 1.0)
            return i, rng.sample(normalized_or(row, p_path[i], total))
    return block_len, rng.sample(p_path[block_len])


def verify_token(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """(K, L) tokens, (K, L, V) q, (K, L+1, V) p -> result on path 0: the host form on the CPU, the
    device form (one host read) elsewhere."""
    check_shapes(draft_tokens, q, p)
    if uses_device_form(p):
        outcome = token_verify_on_device(draft_tokens[0], q[0], p[0], rng)
    else:  # the host form's compiled call where it runs, on the (K, ...) inputs as they are
        outcome = single_path_compiled(draft_tokens, q, p, rng, False)
        if outcome is None:
            outcome = token_verify_host(draft_tokens[0], q[0], p[0], rng)
    return VerifyResult(0, *outcome)
