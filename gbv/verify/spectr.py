"""SpecTr, K-SEQ verification over K i.i.d. paths. SPEC section 5.

Sun, Suresh, Ro, Beirami, Jain, Yu, "SpecTr: Fast Speculative Decoding via Optimal Transport",
NeurIPS 2023 (algorithm K-SEQ).

Level by level, on the ``k`` alive paths (those agreeing with every token emitted so far; they share
a prefix, so the row of the first alive path gives ``p = p_d`` and ``q = q_d``). With
``beta(rho) = sum_x min(q(x), p(x) / rho)``, pick the smallest ``rho`` in ``[1, k]`` with
``rho * beta(rho) >= 1 - (1 - beta(rho))^k`` (:func:`_smallest_rho`). Try the alive draws in
path-index order, accepting ``y_j`` with probability ``min(1, p(y_j) / (rho * q(y_j)))``; continue
with the paths carrying the accepted token. If all are rejected emit
``Y ~ norm((p - min(q, p / rho) * (1 - (1 - beta)^k) / beta)+)`` and stop. Bonus ``Y ~ p_L`` after
depth ``L``. With ``k = 1``, ``rho = 1`` and this is token-level speculative sampling.

Why it is lossless for *any* ``rho`` satisfying the inequality: a token ``x`` is accepted with total
probability ``min(q(x), p(x)/rho) * (1 - (1-beta)^k) / beta <= p(x)``, and the residual makes up the
difference exactly. So the code only needs a ``rho`` that provably satisfies the inequality; it need
not be exactly the smallest one (which only maximises acceptance).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from gbv.verify import common
from gbv.verify.block import normalized_or
from gbv.verify.common import (RandomSource, VerifyResult, residual_on_device, uses_device_form,
                               verify_level_by_level, verify_level_by_level_on_device)
from gbv.verify.ranking import host_array

# Relative width of the final bisection bracket for rho. The returned value is the bracket's upper
# end, at which the K-SEQ inequality was checked to hold, so rho is at most this far above the exact
# smallest valid rho (acceptance is then lower by a relative ~1e-12 at most) and the verifier stays
# exactly lossless.
RHO_TOLERANCE = 1e-12
_MAX_BISECTION_STEPS = 200


def _smallest_rho(p: Tensor, q: Tensor, k: int) -> float:
    """Smallest ``rho`` in ``[1, k]`` with ``rho * beta(rho) >= 1 - (1 - beta(rho))^k`` (to RHO_TOLERANCE).

    ``f(rho) = rho * beta(rho) - 1 + (1 - beta(rho))^k`` is nondecreasing in ``rho`` (``rho * beta(rho)
    = sum min(rho q, p)`` grows, ``beta`` shrinks) and ``f(k) >= 0`` (Bernoulli), so bisection applies.
    ``g(rho) = rho * beta(rho)`` is piecewise linear with breakpoints at the ratios ``t = p(x) / q(x)``;
    one vectorised pass evaluates ``f`` at every breakpoint in ``(1, k)`` and finds the segment
    holding the root, on which ``g(rho) = a * rho + b``; the bisection then runs on scalars inside
    that segment. Only the breakpoints in ``(1, k)`` are sorted: the root is not below 1, nor above k,
    so the tokens with ``t <= 1`` enter as one sum and those with ``t >= k`` (or 0 / 0) not at all.
    Host code on float64 numpy copies of the rows (the host form: an ``argsort`` of the few
    breakpoints in ``(1, k)`` instead of torch's sort of all V, 0.3 ms at V = 4096 here).

    Args:
        p: (V,) target distribution; q: (V,) draft distribution; k: number of alive draws.
    Returns:
        The upper end of the final bracket (the inequality holds there).
    """
    if k <= 1:
        return 1.0  # f == 0 identically for k = 1
    p, q = host_array(p), host_array(q)
    kernels = common.compiled_kernels
    if (kernels is not None and p.dtype == q.dtype and p.dtype in (np.float32, np.float64) and p.flags.c_contiguous
            and q.flags.c_contiguous):
        # One compiled call: the same steps on the same float64 values, its sums in order (to rounding);
        # the numpy code below is ~15 calls, ~0.2 ms a level right after a forward.
        return kernels.spectr_rho(p, q, p.dtype == np.float64, k, RHO_TOLERANCE, _MAX_BISECTION_STEPS)
    p, q = p.astype(np.float64, copy=False), q.astype(np.float64, copy=False)
    beta1 = float(np.minimum(p, q).sum())
    if beta1 - 1.0 + (1.0 - beta1) ** k >= 0.0:
        return 1.0  # beta(1) is 0 or 1 (disjoint supports, or p = q): rho = 1 is valid
    with np.errstate(divide="ignore", invalid="ignore"):
        t = p / q  # q = 0 gives +inf or NaN: never in (1, k), and they add nothing to beta
    low = t <= 1.0
    inside = ((t > 1.0) & (t < k)).nonzero()[0]
    inside = inside[t[inside].argsort()]  # the breakpoints in (1, k), ascending
    t_in, p_in, q_in = t[inside], p[inside], q[inside]
    p_low, q_low, q_total = float(p.sum(where=low)), float(q.sum(where=low)), float(q.sum())
    # g(t_j) = (p-mass of the tokens up to j) + t_j (q-mass of the tokens after j): exact, ties included.
    cum_p = p_low + p_in.cumsum()
    q_above = q_total - (q_low + q_in.cumsum())
    g = cum_p + t_in * q_above
    f = (1.0 - g / t_in) ** k + g - 1.0  # f(t_j) = g - 1 + (1 - g / t)^k, nondecreasing along t
    # The root lies in (lo, hi]: hi = the first breakpoint in (1, k) where the inequality holds, else
    # k; lo = the breakpoint before it (the largest t <= 1 if none is inside). No breakpoint lies
    # strictly between, so there g(rho) = a * rho + b with b = p-mass up to lo, a = q-mass above lo.
    first = int((f >= 0.0).argmax()) if (f >= 0.0).any() else len(t_in)
    hi = float(t_in[first]) if first < len(t_in) else float(k)
    if first > 0:
        lo_t, b, a = float(t_in[first - 1]), float(cum_p[first - 1]), float(q_above[first - 1])
    elif low.any():
        lo_t, b, a = float(t[low].max()), p_low, q_total - q_low
    else:
        lo_t, b, a = 0.0, 0.0, q_total  # no breakpoint below the root: g = rho * (all of q)
    lo = max(1.0, lo_t)

    def excess(rho: float) -> float:
        return a * rho + b - 1.0 + (1.0 - a - b / rho) ** k

    if b <= 0.0 < a:
        # No target mass below the segment (e.g. one-hot p): f is linear there, root in closed form.
        root = (1.0 - (1.0 - a) ** k) / a
        if lo <= root <= hi and excess(root) >= 0.0:
            return root
    for _ in range(_MAX_BISECTION_STEPS):
        if hi - lo <= RHO_TOLERANCE * hi:
            break
        mid = 0.5 * (lo + hi)
        if excess(mid) >= 0.0:
            hi = mid
        else:
            lo = mid
    return hi


def _accept_prob(p_y: float, q_y: float, rho: float) -> float:
    """``min(1, p(y) / (rho q(y)))``; a drafted token has ``q(y) > 0``, the guard only avoids 0 / 0."""
    if q_y <= 0.0:
        return 1.0 if p_y > 0.0 else 0.0
    return min(1.0, p_y / (rho * q_y))


def _kseq_residual(p: np.ndarray | Tensor, q: np.ndarray | Tensor, rho: float, k: int) -> Tensor:
    """``norm((p - min(q, p/rho) * (1 - (1-beta)^k) / beta)+)`` of (V,) rows, in float64, as a (V,)
    tensor; ``p`` when ``beta = 0``."""
    p, q = host_array(p).astype(np.float64, copy=False), host_array(q).astype(np.float64, copy=False)
    overlap = np.minimum(q, p / rho)
    beta = float(overlap.sum())
    if beta <= 0.0:  # nothing can be accepted (disjoint supports): the residual is p itself
        return torch.from_numpy(p)
    scale = (1.0 - (1.0 - beta) ** k) / beta
    return normalized_or(np.maximum(p - overlap * scale, 0.0), torch.from_numpy(p))


def _kseq_level(p_d: Tensor, q_d: Tensor, draws: list[int], rng: RandomSource) -> tuple[int | None, Tensor | None]:
    """One level: the smallest valid rho for ``k = len(draws)``, then the draws in order. On numpy
    views of the node's rows (the host form: numpy's fixed cost per call is a fifth of torch's, and
    right after a forward every call runs from a cold cache)."""
    k = len(draws)
    p_row, q_row = host_array(p_d), host_array(q_d)
    rho = _smallest_rho(p_row, q_row, k)
    for y in draws:
        if rng.accept(_accept_prob(float(p_row[y]), float(q_row[y]), rho)):
            return y, None
    return None, _kseq_residual(p_row, q_row, rho, k)


def verify_spectr(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """SpecTr K-SEQ, level-wise over the K drafted paths.

    Args:
        draft_tokens: (K, L) long, K paths drawn i.i.d. from the draft.
        q: (K, L, V) draft distributions each token was sampled from.
        p: (K, L+1, V) target distributions after each prefix of each path.
        rng: the random source (``accept`` / ``sample``).
    Returns:
        ``VerifyResult(path, accepted_len, next_token)``; ``path`` is the first (lowest-index) path
        carrying the accepted prefix.
    """
    if uses_device_form(p):  # one host read instead of one per coin and root search: see below
        return verify_spectr_on_device(draft_tokens, q, p, rng)
    return verify_spectr_on_host(draft_tokens, q, p, rng)


def verify_spectr_on_host(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """The host form (what :func:`verify_spectr` runs on CPU tensors): the level loop and the root
    search on the host, one coin read back per trial, stopping at the first rejected level."""
    return verify_level_by_level(draft_tokens, q, p, rng, _kseq_level)


# The device form's root search: rounds of a grid of this many points over the bracket. Four rounds
# of 1024 narrow it by 1024^4 ~ 1e12, about RHO_TOLERANCE, in a fixed number of tensor calls.
_GRID_POINTS = 1024
_GRID_ROUNDS = 4


def _smallest_rho_on_device(p: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """:func:`_smallest_rho` without a host read: (V,) float64 ``p``, ``q`` and a 0-d float64 ``k`` (the
    number of alive draws) -> 0-d float64 ``rho`` at which the K-SEQ inequality holds.

    The same segment search (one sort, cumulative sums, the first breakpoint where ``f >= 0``), then
    instead of a scalar bisection ``_GRID_ROUNDS`` rounds of a grid over the segment: each keeps the
    first grid point where ``excess >= 0`` as the new upper end (the old one if none is, so the
    upper end always satisfies the inequality as computed). Within the segment ``f`` is
    nondecreasing, so this brackets the same root as the bisection, to about the same tolerance.
    """
    vocab = p.shape[0]
    beta1 = torch.minimum(p, q).sum()
    trivial = (k <= 1) | (beta1 - 1.0 + (1.0 - beta1) ** k >= 0.0)  # rho = 1 is valid
    t, order = torch.sort(p / q)
    cum_p, cum_q = torch.stack((p, q))[:, order].cumsum(1)
    q_above = cum_q[-1] - cum_q
    g = torch.addcmul(cum_p, t, q_above)
    f = (1.0 - g / t) ** k + g - 1.0
    stop = (f.ge(0.0) & t.gt(1.0)) | ~t.lt(k)
    first = stop.cumsum(0).eq(0).sum()  # count of leading Falses, in [0, V]
    below = (first - 1).clamp(min=0)
    lo_t = torch.where(first > 0, t[below.reshape(1)][0], 0.0)
    b = torch.where(first > 0, cum_p[below.reshape(1)][0], 0.0)
    a = torch.where(first > 0, q_above[below.reshape(1)][0], q_above[0] + cum_q[0])
    t_first = torch.where(first < vocab, t[first.clamp(max=vocab - 1).reshape(1)][0], math.nan)
    hi = torch.where(t_first < k, t_first, k)  # NaN (q = p = 0 tokens) also gives k
    lo = torch.clamp(lo_t, min=1.0)

    def excess(rho: Tensor) -> Tensor:
        return a * rho + b - 1.0 + (1.0 - a - b / rho) ** k

    # No target mass below the segment (e.g. one-hot p): the root in closed form, where it checks.
    root = (1.0 - (1.0 - a) ** k) / torch.where(a > 0, a, 1.0)
    closed = (b <= 0.0) & (a > 0.0) & (lo <= root) & (root <= hi) & (excess(root) >= 0.0)
    steps = torch.arange(1, _GRID_POINTS + 1, dtype=torch.float64, device=p.device) / _GRID_POINTS
    for _ in range(_GRID_ROUNDS):
        points = lo + (hi - lo) * steps
        points[-1] = hi
        ok = excess(points) >= 0.0
        ok[-1] = True
        index = ok.to(torch.uint8).argmax()
        new_hi = points[index.reshape(1)][0]
        lo = torch.where(index > 0, points[(index - 1).clamp(min=0).reshape(1)][0], lo)
        hi = new_hi
    # A margin of RHO_TOLERANCE above the bracket's end, as the host's bisection leaves one: the grid
    # can end within rounding of the root, where the segment's linear form of f and the full sums
    # disagree in the last bits (f is nondecreasing, so a larger rho stays valid).
    hi = torch.minimum(hi * (1.0 + RHO_TOLERANCE), k)
    return torch.where(trivial, 1.0, torch.where(closed, root, hi))


def _kseq_level_on_device(p_d: Tensor, q_d: Tensor, draws: Tensor, alive: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_kseq_level` as tensor code: ``rho`` for ``k`` = the number of alive draws, every alive
    draw's acceptance probability ``min(1, p(y) / (rho q(y)))`` (the same for each trial: K-SEQ's
    rule does not change between its draws) and the K-SEQ residual. (K,) float64, (V,) float64."""
    p64, q64 = p_d.double(), q_d.double()
    k = alive.sum().double()
    rho = _smallest_rho_on_device(p64, q64, k)
    p_y, q_y = p64.gather(0, draws), q64.gather(0, draws)
    prob = torch.where(q_y > 0, torch.clamp(p_y / (rho * torch.where(q_y > 0, q_y, 1.0)), max=1.0),
                       (p_y > 0).double())
    overlap = torch.minimum(q64, p64 / rho)
    beta = overlap.sum()
    scale = (1.0 - (1.0 - beta) ** k) / torch.where(beta > 0, beta, 1.0)
    correction = residual_on_device(p64, overlap * scale)  # norm((p - overlap scale)+), p if no mass
    return torch.where(alive, prob, 0.0), torch.where(beta > 0, correction, p64)


def verify_spectr_on_device(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """SpecTr K-SEQ as tensor code on the inputs' device with one host read per call (what
    :func:`verify_spectr` runs on a GPU): :func:`gbv.verify.common.verify_level_by_level_on_device`
    with the rule above. The host form reads back its coins and its root search (11-23 reads per
    call at K = 2-8). The exact enumeration proves both lossless (tests/verify/test_spectr_device.py)."""
    return verify_level_by_level_on_device(draft_tokens, q, p, rng, _kseq_level_on_device)
