"""Block verification, BV (Sun et al., ICLR 2025), one path. SPEC section 2.

BV decides the accepted length jointly for the whole block instead of token by token, which is
optimal for a single path. Two forms of the same rule:

- :func:`block_verify_on_device` (``block`` itself, and GBV with K = 1, off the CPU): tensor code on
  the inputs' device with full rows, one host read per verify call (the stop decisions are
  independent coins drawn at once, the next token by inverse CDF); on the CPU,
  :func:`block_verify_host` runs the core below on numpy views of the rows instead;
- :func:`block_verify_core` (the last step of GBV and gbv-adaptive, :mod:`gbv.verify.gbv`): host
  floats, given only the on-path ratios and callbacks for the residual masses and the correction
  row, so that the skewed law ``q_G`` is never built as full rows.

Both are proven lossless by the same exact enumeration (tests/verify), and GBV with one path, which
runs the first form, equals BV.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from gbv.verify import common
from gbv.verify.common import (BELOW_ONE, RandomSource, Refinement, TorchRandom, VerifyResult, check_shapes,
                               host_ints, on_path_probs, residual_on_device, take_row, uses_device_form)
from gbv.verify.ranking import MASS_MARGIN, MassBounds, host_array


# residual_bounds(rows, weights) -> the residual masses r_i = sum_x (w_i p_i(x) - q_i(x))+ of the given
# nodes i (1 <= i < L), as gbv.verify.ranking.MassBounds (bounds, each exact value on demand).
ResidualBounds = Callable[[list[int], list[float]], MassBounds]
# residual_dist(i, w_i) -> (V,) norm((w_i p_i - q_i)+), the correction distribution at node i < L.
ResidualDist = Callable[[int, float], Tensor]


def block_verify_core(ratios: list[float], residual_bounds: ResidualBounds, residual_dist: ResidualDist,
                      bonus: Tensor, rng: RandomSource) -> tuple[int, int]:
    """BV (SPEC section 2) given only what it needs of the rows.

    Args:
        ratios: ``p_{i-1}(x_i) / q_{i-1}(x_i)`` for ``i = 1..L`` (on-path values only).
        residual_bounds: the residual masses ``r_i`` of the nodes where the weight is below 1, as
            :class:`~gbv.verify.ranking.MassBounds` (asked at most once, for all of them together,
            and not at all when the whole block is accepted; where ``w_i = 1``, ``h_i = 1`` whatever
            ``r_i`` is): cheap bounds, tighter ones and the exact value each on demand.
            ``h_i = r_i / (r_i + 1 - w_i)`` grows with ``r_i``, so bounds of ``r_i`` bound ``h_i``,
            and the stop coin asks for the next step only when its uniform falls between the
            current bounds (``rng.accept_within`` with a :class:`~gbv.verify.common.Refinement`:
            the same law as ``rng.accept(h_i)``).
        residual_dist: the correction distribution at the accepted length, asked at most once.
        bonus: (V,) ``p_L``, sampled when the whole block is accepted.
    Returns:
        ``(accepted_len, next_token)``.
    """
    block_len = len(ratios)
    weights = block_weights(ratios)
    # The stop coins run from i = L down. The first one, h_L = w_L, needs no residual mass: draw it
    # before computing any (a whole block accepted needs none; same coins in the same order).
    if rng.accept(weights[block_len]):
        return block_len, rng.sample(bonus)
    needed = [i for i in range(1, block_len) if weights[i] < 1.0]
    bounds = residual_bounds(needed, [weights[i] for i in needed]) if needed else None
    slot = {i: j for j, i in enumerate(needed)}

    def stop_prob(r: float, w: float) -> float:
        # r + (1 - w), not r + 1 - w: with w = 1 this gives exactly r / r = 1 (no 1 - 2e-16 branch).
        denom = r + (1.0 - w)
        return 1.0 if denom <= 0.0 else r / denom

    accepted_len = 0
    for i in range(block_len - 1, 0, -1):
        if i not in slot:
            stop = rng.accept(1.0)  # w_i = 1: h_i = 1
        else:
            j, w = slot[i], weights[i]

            def tighter(j=j, w=w) -> Refinement:
                low, high = bounds.tighter(j)
                return Refinement(stop_prob(low, w), stop_prob(high, w), lambda: stop_prob(bounds.exact(j), w))

            stop = rng.accept_within(stop_prob(bounds.low[j], w), stop_prob(bounds.high[j], w), tighter)
        if stop:
            accepted_len = i
            break
    return accepted_len, rng.sample(residual_dist(accepted_len, weights[accepted_len]))


def block_weights(ratios: list[float]) -> list[float]:
    """BV's weights ``[w_0, .., w_L]``: ``w_0 = 1``, ``w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i))``,
    from the on-path ratios (:func:`path_ratios`); see :func:`path_weights`."""
    weights = [1.0]
    for ratio in ratios:
        weights.append(min(1.0, weights[-1] * ratio))
    return weights


def path_weights(tokens: Tensor, q_path: Tensor, p_path: Tensor) -> list[float]:
    """``[w_1, .., w_L]`` of one drafted path on the host (shapes as :func:`block_verify_on_device`).

    ``w_i`` is the chance that BV with a block of any length ``L >= i`` keeps the first ``i`` drafted
    tokens, given them: ``P(accepted_len >= i | x_1..x_i) = w_i`` (tests/verify/test_block_weights.py,
    by exact enumeration), so ``E[accepted_len] = sum_i E[w_i]`` (SPEC section 2). So accepted lengths
    pooled over block lengths, as ``auto`` pools them (:class:`gbv.engine.auto._Acceptance`), estimate
    each length's yield without bias; ``scripts/bv_path_weights.py`` compares the two on the bundled pair."""
    return block_weights(on_path_host(tokens, q_path, p_path)[2])[1:]


def block_verify_on_device(tokens: Tensor, q_path: Tensor, p_path: Tensor, rng: RandomSource
                           ) -> tuple[Tensor, Tensor]:
    """BV on one path, as tensor code without host reads.

    Args:
        tokens: (L,) drafted tokens.
        q_path: (L, V) the law each token was drawn from, given the path so far.
        p_path: (L+1, V) target distributions along the path.
    Returns:
        ``(accepted_len, next_token)`` as 0-d long tensors on the inputs' device.

    The stopping rule "for i = L .. 1, stop at i with probability h_i" is drawn as L independent
    coins at once, ``tau`` = the largest index whose coin came up (0 if none): the same law, since
    ``P(tau = i) = h_i * prod_{j > i} (1 - h_j)`` either way.
    """
    block_len = tokens.shape[0]
    ratios = on_path_probs(p_path[:block_len], tokens).double() / on_path_probs(q_path, tokens).double()
    # w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i)), w_0 = 1, one step at a time so that w is exactly 1
    # wherever the running product reaches 1 (a cumulative closed form would round there).
    weights = [torch.ones((), dtype=torch.float64, device=p_path.device)]
    for i in range(block_len):
        weights.append(torch.clamp(weights[-1] * ratios[i], max=1.0))
    w = torch.stack(weights)  # (L+1,)
    # Residual masses r_i = sum_x (w_i p_i(x) - q_i(x))+ for 1 <= i < L, all positions at once.
    w_cast = w.to(p_path.dtype)
    r = (w_cast[1:block_len, None] * p_path[1:block_len] - q_path[1:block_len]).clamp_min(0.0).sum(-1).double()
    # h_i = r / (r + (1 - w)): with w = 1 this is exactly r / r = 1 (no 1 - 2e-16 branch); 1 on 0 / 0.
    denom = r + (1.0 - w[1:block_len])
    h = torch.where(denom > 0, r / torch.where(denom > 0, denom, 1.0), 1.0)
    stop_probs = torch.cat([h, w[block_len:]])  # h_1 .. h_L
    depths = torch.arange(1, block_len + 1, device=p_path.device)
    accepted_len = torch.where(rng.coins(stop_probs), depths, 0).max()
    # Next token: p_L after a full block, else norm((w_tau p_tau - q_tau)+); the q row is zeroed at tau = L.
    p_tau = take_row(p_path, accepted_len)
    q_tau = take_row(q_path, accepted_len.clamp(max=block_len - 1)) * (accepted_len < block_len)
    next_token = rng.draw(residual_on_device(p_tau, q_tau, take_row(w_cast, accepted_len)))
    return accepted_len, next_token


def positive_part_and_sum(p_row: np.ndarray, q_row: np.ndarray, w: float) -> tuple[np.ndarray, float]:
    """``(w p - q)+`` of one node's (V,) rows in float64 (the residual of BV at weight ``w``), and its
    sum. The compiled form (float32 ``p``; one pass instead of four numpy passes, their allocations and
    the sum) gives the same row and the sum to rounding."""
    kernels = common.compiled_kernels
    if (kernels is not None and p_row.dtype == np.float32 and q_row.dtype in (np.float32, np.float64)
            and p_row.flags.c_contiguous and q_row.flags.c_contiguous):
        row = np.empty(p_row.shape[-1])
        return row, kernels.positive_part(p_row, q_row, q_row.dtype == np.float64, float(w), row)
    row = np.maximum(w * p_row.astype(np.float64) - q_row, 0.0)
    return row, float(row.sum())


def on_path_host(tokens: Tensor, q_path: Tensor, p_path: Tensor) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """numpy views of one path's (L, V) q and (L+1, V) p rows, and the on-path ratios
    ``p_{i-1}(x_i) / q_{i-1}(x_i)`` in float64 (inf where only q is 0; 0 for 0 / 0): the start of the
    host forms of BV and of token-level sampling."""
    q_h, p_h = host_array(q_path), host_array(p_path)
    depth = np.arange(tokens.shape[0])
    drafted = host_array(tokens)
    p_on = p_h[depth, drafted].astype(np.float64).tolist()
    q_on = q_h[depth, drafted].astype(np.float64).tolist()
    return q_h, p_h, path_ratios(p_on, q_on)


def path_ratios(p_on: list[float], q_on: list[float]) -> list[float]:
    """BV's on-path ratios ``p_{i-1}(x_i) / q_{i-1}(x_i)`` from the on-path values of ``p`` and of the
    draft law (``q``, or the law of a selected path): inf where only the law is 0, 0 for 0 / 0."""
    return [pp / qq if qq > 0.0 else (math.inf if pp > 0.0 else 0.0) for pp, qq in zip(p_on, q_on)]


def normalized_or(dist: np.ndarray, fallback: Tensor, total: float | None = None) -> Tensor:
    """``dist / dist.sum()`` as a tensor (``total``: the sum, when known), or ``fallback`` where ``dist``
    has no mass (a branch of probability 0 in exact arithmetic: round-off only, as
    :func:`gbv.verify.common.normalize_or`). ``dist`` is divided in place."""
    total = float(dist.sum()) if total is None else total
    if total <= 0.0:
        return fallback
    dist /= total
    return torch.from_numpy(dist)


def single_path_compiled(tokens: Tensor, q_path: Tensor, p_path: Tensor, rng: RandomSource,
                         block: bool) -> tuple[int, int] | None:
    """BV (``block``) or token-level sampling on one path (shapes as :func:`block_verify_on_device`, or
    the verifiers' (K, L), (K, L, V), (K, L+1, V) inputs, of which path 0) as one compiled call
    (``_verify_kernels.single_path``): the same ``(accepted_len, next_token)`` as
    :func:`block_verify_host` / :func:`gbv.verify.token.token_verify_host`, bit for bit, with the
    same uniforms from ``rng``. None where it does not run: no compiled helpers, a random source other
    than :class:`TorchRandom` (the exact enumerator replays the numpy code's ``accept`` and
    ``sample``), rows that are not contiguous float32 host tensors.

    Why: the numpy form is ~25 Python, numpy and torch calls; right after the target's forward each
    runs from a cold cache, and a BV call took 0.15-0.2 ms on the bundled pair here."""
    kernels = common.compiled_kernels
    single_path = getattr(kernels, "single_path", None)  # (None when the tests switch it off)
    if (single_path is None or not isinstance(rng, TorchRandom) or not q_path.dtype == p_path.dtype == torch.float32
            or tokens.dtype != torch.long or not (q_path.is_cpu and p_path.is_cpu and tokens.is_cpu)
            or not (q_path.is_contiguous() and p_path.is_contiguous() and tokens.is_contiguous())):
        return None
    q_h, p_h, drafted = q_path.numpy(), p_path.numpy(), tokens.numpy()
    if q_h.ndim == 3:  # (K, L, V) and the like: path 0 (numpy's indexing is cheaper than torch's)
        q_h, p_h, drafted = q_h[0], p_h[0], drafted[0]
    block_len, vocab = q_h.shape
    return single_path(q_h, p_h, drafted, block_len, vocab, block, rng.uniform, np.empty(vocab), MASS_MARGIN,
                       BELOW_ONE)


def block_verify_host(tokens: Tensor, q_path: Tensor, p_path: Tensor, rng: RandomSource) -> tuple[int, int]:
    """BV on one path on the host: :func:`block_verify_core` with the rows as numpy views (float64
    sums), each residual mass computed only when its stop coin needs it (bounds ``0 <= r_i <= w_i
    sum p_i`` first). Why: the tensor form is about 100 small torch calls, ~1 ms at V = 4096 on this
    CPU; this is a few dozen numpy calls, or one compiled call (:func:`single_path_compiled`) where
    that runs. Shapes as :func:`block_verify_on_device`."""
    compiled = single_path_compiled(tokens, q_path, p_path, rng, True)
    if compiled is not None:
        return compiled
    block_len = tokens.shape[0]
    q_h, p_h, ratios = on_path_host(tokens, q_path, p_path)
    computed: dict[tuple[int, float], tuple[np.ndarray, float]] = {}

    def positive_part(i: int, w: float) -> tuple[np.ndarray, float]:
        # the exact mass and the correction row of a node come from the same row (computed once)
        if (i, w) not in computed:
            computed[(i, w)] = positive_part_and_sum(p_h[i], q_h[i], w)
        return computed[(i, w)]

    def residual_bounds(rows: list[int], weights: list[float]) -> MassBounds:
        totals = p_h[rows].sum(-1, dtype=np.float64).tolist()
        high = [w * total * (1.0 + MASS_MARGIN) for w, total in zip(weights, totals)]
        return MassBounds([0.0] * len(rows), high, exact=lambda j: positive_part(rows[j], weights[j])[1])

    def residual_dist(i: int, w: float) -> Tensor:
        row, total = positive_part(i, w)
        return normalized_or(row, p_path[i], total)

    return block_verify_core(ratios, residual_bounds, residual_dist, p_path[block_len], rng)


def block_verify_path(tokens: Tensor, q_path: Tensor, p_path: Tensor, rng: RandomSource) -> tuple[int, int]:
    """BV on one path -> ``(accepted_len, next_token)`` ints: :func:`block_verify_host` on the CPU,
    else :func:`block_verify_on_device` with its result read back (one host read)."""
    if not uses_device_form(p_path):
        return block_verify_host(tokens, q_path, p_path, rng)
    accepted_len, next_token = block_verify_on_device(tokens, q_path, p_path, rng)
    tau, token = host_ints(accepted_len, next_token)
    return tau, token


def verify_block(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """(K, L) tokens, (K, L, V) q, (K, L+1, V) p -> BV result on path 0."""
    check_shapes(draft_tokens, q, p)
    # the host form's compiled call where it runs (on the CPU), else as before
    outcome = None if uses_device_form(p) else single_path_compiled(draft_tokens, q, p, rng, True)
    if outcome is None:
        outcome = block_verify_path(draft_tokens[0], q[0], p[0], rng)
    return VerifyResult(0, *outcome)
