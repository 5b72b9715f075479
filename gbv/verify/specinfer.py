"""SpecInfer: recursive rejection sampling with replacement over K i.i.d. paths. SPEC section 4.

Miao et al., "SpecInfer: Accelerating Large Language Model Serving with Tree-based Speculative
Inference and Verification", ASPLOS 2024 (its multi-step speculative sampling, run level-wise on
the K i.i.d. paths). Sampling the children without replacement instead gives RSD (Jeon et al.,
"Recursive Speculative Decoding", 2024), which is not implemented here.

Level by level: at depth ``d`` the *alive* paths are those that agree with every token emitted so
far, so they share one prefix and their ``p``/``q`` rows at ``d`` are identical (the row of the
first alive path is used). Their tokens at ``d`` are i.i.d. draws from ``q_d``. Starting from
``r = p_d``, the draws are tried in path-index order: accept ``y_j`` with probability
``min(1, r(y_j) / q_d(y_j))``; on rejection ``r <- norm((r - q_d)+)``. Duplicates are tried again
(each copy is its own trial; skipping them breaks losslessness). If every alive draw is rejected,
emit ``Y ~ r`` and stop. If all ``L`` levels accept, emit the bonus ``Y ~ p_L``.

At temperature 0 (one-hot ``p``) a draw is accepted iff it equals the target argmax, and every
residual is ``p`` itself, so the result is the longest argmax-matching drafted prefix over all paths,
then the argmax (SPEC section 8).
"""

from __future__ import annotations

from torch import Tensor

from gbv.verify.common import RandomSource, VerifyResult, residual, verify_level_by_level


def _trial_order(draws: list[int]) -> list[int]:
    """The draws tried at one level, in order: every alive path's draw, duplicates included
    (each copy is its own trial; skipping copies breaks losslessness)."""
    return draws


def _accept_prob(r_y: float, q_y: float) -> float:
    """``min(1, r(y) / q(y))``; a drafted token has ``q(y) > 0``, the guard only avoids 0 / 0."""
    if q_y <= 0.0:
        return 1.0 if r_y > 0.0 else 0.0
    return min(1.0, r_y / q_y)


def _specinfer_level(p_d: Tensor, q_d: Tensor, draws: list[int], rng: RandomSource) -> tuple[int | None, Tensor]:
    """One level: try the draws against the running residual ``r`` (starting at ``p_d``)."""
    r = p_d
    for y in _trial_order(draws):
        if rng.accept(_accept_prob(float(r[y]), float(q_d[y]))):
            return y, r
        r = residual(r, q_d)  # norm((r - q_d)+); falls back to r on a zero-mass (round-off) residual
    return None, r


def verify_specinfer(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """Recursive rejection sampling, with replacement, over the K drafted paths.

    Args:
        draft_tokens: (K, L) long, K paths drawn i.i.d. from the draft.
        q: (K, L, V) draft distributions each token was sampled from.
        p: (K, L+1, V) target distributions after each prefix of each path.
        rng: the random source (``accept`` / ``sample``).
    Returns:
        ``VerifyResult(path, accepted_len, next_token)``; ``path`` is the first (lowest-index) path
        carrying the accepted prefix.
    """
    return verify_level_by_level(draft_tokens, q, p, rng, _specinfer_level)
