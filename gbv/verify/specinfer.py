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

import torch
from torch import Tensor

from gbv.verify.common import (RandomSource, VerifyResult, residual, residual_on_device, uses_device_form,
                               verify_level_by_level, verify_level_by_level_on_device)


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
    if uses_device_form(p):  # one host read instead of one per trial: see verify_specinfer_on_device
        return verify_specinfer_on_device(draft_tokens, q, p, rng)
    return verify_specinfer_on_host(draft_tokens, q, p, rng)


def verify_specinfer_on_host(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """The host form (what :func:`verify_specinfer` runs on CPU tensors): the level loop on the host,
    one coin read back per trial, stopping at the first rejected level."""
    return verify_level_by_level(draft_tokens, q, p, rng, _specinfer_level)


def _specinfer_level_on_device(p_d: Tensor, q_d: Tensor, draws: Tensor, alive: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_specinfer_level` as tensor code: the running residual after each alive draw's
    rejection, and from it every alive draw's acceptance probability ``min(1, r(y) / q(y))``, in path
    order (duplicates included, as in the host rule); the residual after all of them for the
    correction. (K,) float64 probabilities, (V,) residual."""
    r = p_d
    on_r = []
    for k in range(draws.shape[0]):
        on_r.append(r.gather(0, draws[k:k + 1]))  # r(y_k), the residual trial k is judged against
        r = torch.where(alive[k], residual_on_device(r, q_d), r)
    r_y, q_y = torch.cat(on_r).double(), q_d.gather(0, draws).double()
    # min(1, r / q); a drafted token has q > 0, the guard only avoids 0 / 0 (as _accept_prob).
    probs = torch.where(q_y > 0, torch.clamp(r_y / torch.where(q_y > 0, q_y, 1.0), max=1.0), (r_y > 0).double())
    return torch.where(alive, probs, 0.0), r


def verify_specinfer_on_device(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """SpecInfer as tensor code on the inputs' device with one host read per call (what
    :func:`verify_specinfer` runs on a GPU): :func:`gbv.verify.common.verify_level_by_level_on_device`
    with the rule above. The host form reads each trial's coin back as it goes (7-27 reads per call
    at K = 2-8), which costs nothing on this CPU and stalls a GPU's queue each time. The exact
    enumeration proves both lossless (tests/verify/test_specinfer_device.py)."""
    return verify_level_by_level_on_device(draft_tokens, q, p, rng, _specinfer_level_on_device)
