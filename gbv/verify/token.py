"""Token-level speculative sampling (Leviathan et al. 2023; Chen et al. 2023), one path. SPEC section 1.

Accept drafted token ``x_i`` with probability ``min(1, p(x_i) / q(x_i))``; at the first rejection emit
a token from ``norm((p - q)+)``; if all ``L`` are accepted emit a bonus token from ``p_L``.
Only path 0 is used when ``K > 1``.
"""

from __future__ import annotations

from torch import Tensor

from gbv.verify.common import (RandomSource, VerifyResult, check_shapes, host_ints, on_path_probs, residual_on_device,
                               take_row)


def verify_token(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """(K, L) tokens, (K, L, V) q, (K, L+1, V) p -> result on path 0. One host read.

    The L accept/reject decisions are drawn as independent coins at once; the accepted length is the
    number of leading accepted coins (coins after the first rejection are never looked at, so the
    law is that of the sequential rule).
    """
    _, block_len, _ = check_shapes(draft_tokens, q, p)
    tokens, q0, p0 = draft_tokens[0], q[0], p[0]
    # Drafted tokens have q > 0, so the ratio is finite; a one-hot p (temperature 0) gives 0 or 1.
    accept_probs = (on_path_probs(p0[:block_len], tokens) / on_path_probs(q0, tokens)).clamp(max=1.0)
    accepted_len = rng.coins(accept_probs).long().cumprod(0).sum()
    # After a rejection at tau: norm((p_tau - q_tau)+); after a full block: p_L (q row zeroed).
    q_tau = take_row(q0, accepted_len.clamp(max=block_len - 1)) * (accepted_len < block_len)
    next_token = rng.draw(residual_on_device(take_row(p0, accepted_len), q_tau))
    tau, token = host_ints(accepted_len, next_token)
    return VerifyResult(0, tau, token)
