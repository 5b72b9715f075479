"""Adaptive greedy selection, ``gbv-adaptive`` (beyond the paper). SPEC section 11.

GBV (:mod:`gbv.verify.gbv`) always follows the best-ranked candidate down the tree of drafted paths,
which skews the verified path's law away from ``p`` even where ``q`` already matched ``p``: it is not
monotone in K and falls below plain BV for a close draft. gbv-adaptive decides at every node between
"best-ranked candidate" and "first candidate" with a fresh coin of probability ``lam_n``, the weight
that maximises that node's one-step acceptance ``F(lam) = sum_x min(p_x, lam g_n(x) + (1 - lam) q_x)``,
and tracks the exact law ``q_A`` of the path it selects; BV then runs on that path with ``p`` and
``q_A``. Weight 1 everywhere is GBV, weight 0 everywhere is BV on path 0. Lossless because BV is told
the exact law of the path it verifies and the coins are independent of the drafts.

Shapes for one sequence: K paths, block length L, vocabulary V. The order at a node (key, tie-break,
q-mass ranked below a token) is :mod:`gbv.verify.ranking`, shared with GBV. Per node:

- ``W(y)`` = q-mass ranked strictly below ``y`` (:func:`gbv.verify.ranking.mass_below_rows`);
- ``g_n(y) = (1 - B_y)^n - W_y^n = q_y S_n(W_y + q_y, W_y)`` (best-ranked of ``n`` i.i.d. draws is ``y``);
- ``a(n)``, ``n = 1..K``: relative probability that ``n`` drafted paths share the selected prefix
  (``a = e_K`` at the root), updated after the selected token ``s`` by
  ``a(k) <- sum_n a(n) M_n(s, k)``, ``M_n = lam_n Kg_n + (1 - lam_n) Ku_n``;
- ``q_A(y) = q_y sum_n abar(n) (lam_n S_n(W_y + q_y, W_y) + 1 - lam_n)``, ``abar = a / sum(a)``.

Cost per node: O(K V) elementwise work and no sort of the row. The weight needs ``g_n``, hence ``W``, at
every token. From V = 4096 up the host form takes it on less than the row
(:func:`host_node_weights`): a sharp row is cut to its tokens of non-negligible q, and a flat row's
key buckets stand for its tokens. The law of the selected path uses exact ranks only. Its on-path
``W`` is one masked sum. BV's residual masses and correction row share GBV's bucketed and
candidate-only code, and any weight keeps the method lossless. All arithmetic of the law is float64.
The host form (the CPU) does the per-node work on numpy views of each node's rows, where numpy's
fixed cost per call is a fifth of torch's (docs/VERIFIERS.md, eleventh and twelfth sessions of
issue 8).
"""

from __future__ import annotations

from dataclasses import dataclass
import functools
import math
from math import comb

import numpy as np
import torch
from torch import Tensor

from gbv.verify.block import block_verify_core, block_verify_on_device, block_verify_path, path_ratios
from gbv.verify.common import (RandomSource, VerifyResult, check_shapes, host_ints, take_row,
                               uses_device_form)
from gbv.verify import common, ranking
from gbv.verify.ranking import (MassBounds, best_token, host_array, mass_below_among, mass_below_array,
                                mass_below_rows, mass_below_rows_sorted, occupied_bucket_masses, power_sum,
                                ranking_key, residual_bounds_ranked, residual_row)

# Bins of (0, 1) for the node weight's breakpoints (node_weights): only the crossing bin is sorted.
_WEIGHT_BINS = 1024
# Up to this many tokens, node_weights sorts each row's breakpoints instead of binning them.
_SORT_MAX_VOCAB = 1024
# From V = BUCKET_MIN_VOCAB up, the host form's node weights leave out the tokens with q below this
# much over V on a sharp row (host_node_weights): together at most this much q-mass.
_WEIGHT_MASS_CUT = 1e-6
# Where the verify kernels run, the top-down selection is one compiled call (adaptive_select) instead of
# verify_gbv_adaptive's loop of ~10 Python calls a depth: the same bits and the same coins. A switch for
# the tests that compare the two.
FUSED_SELECTION = True

__all__ = ["AdaptiveLaw", "greedy_step_law", "host_node_weights", "node_weights", "node_weights_on_device",
           "verify_gbv_adaptive", "verify_gbv_adaptive_on_device"]


def greedy_step_law(below: Tensor, q64: Tensor, n: int) -> Tensor:
    """``g_n(y) = (q_y + W_y)^n - W_y^n`` in the stable form ``q_y S_n(W_y + q_y, W_y)``; same shapes."""
    return q64 * power_sum(below + q64, below, n)


def node_weights(p64: Tensor | np.ndarray, q64: Tensor | np.ndarray, below: Tensor | np.ndarray,
                 num_paths: int) -> list[float]:
    """``[lam_0, lam_1, ..., lam_K]`` at one node (``lam_0`` unused, ``lam_1 = 0``); (V,) float64 rows.

    ``lam_n`` is the smallest maximiser over [0, 1] of ``F(lam) = sum_x min(p_x, q_x + lam d_x)``,
    ``d = g_n - q``. ``F`` is concave and piecewise linear. Its right slope at 0 is the sum of ``d_x``
    over the tokens whose ``min`` follows the mixture just right of 0 (``d_x > 0`` and ``p_x > q_x``,
    or ``d_x < 0`` and ``p_x >= q_x``); every breakpoint ``t_x = (p_x - q_x) / d_x`` in (0, 1) lowers
    the slope by ``|d_x|``. The smallest maximiser is the first breakpoint at which the slope is no
    longer positive (0 if it starts so, 1 if it never gets there).

    Rows longer than ``_SORT_MAX_VOCAB`` are not sorted: the breakpoints go into ``_WEIGHT_BINS``
    equal bins of (0, 1) (:func:`_first_crossings_binned`); shorter ones sort their breakpoints
    (:func:`_first_crossings_sorted`, fewer calls). The same weight either way, all ``n`` at once.

    The host form's weight (the CPU), so it runs on numpy arrays (tensors are viewed as arrays).
    :func:`host_node_weights` decides which rows it gets. Where the compiled search is installed
    (``gbv/verify/_verify_kernels.c``) it runs that: one pass per ``n`` and a selection of the crossing
    breakpoint, the same weights up to rounding of the sums, 10-30x faster than numpy's ~25 calls
    over (K - 1, V) rows (fixed costs, at the few hundred tokens a node is cut to).
    """
    if num_paths == 1:
        return [0.0, 0.0]
    p64, q64, below = (host_array(row) if isinstance(row, Tensor) else row for row in (p64, q64, below))
    kernels = common.compiled_kernels  # (looked up at call time: the tests switch it off)
    if kernels is not None:
        rows = (np.ascontiguousarray(row, dtype=np.float64) for row in (p64, q64, below))
        return kernels.node_weights(*rows, num_paths)
    rows_k, vocab = num_paths - 1, q64.shape[-1]
    # d_n = q (S_n(W + q, W) - 1) for n = 2..K: S_n by the recurrence of power_sum, one row per n.
    d = np.empty((rows_k, vocab))
    x = x_pow = below + q64
    np.add(below, x, out=d[0])  # S_2 = W S_1 + x, S_1 = 1
    for row in range(1, rows_k):
        x_pow = x_pow * x
        np.multiply(d[row - 1], below, out=d[row])
        d[row] += x_pow  # S_{n+1} = W S_n + x^n
    d -= 1.0
    d *= q64  # (K-1, V): the S_n rows become d_n (the loop is done reading them)
    diff = p64 - q64
    # Right slope at 0: d where p > q (either sign of d), plus min(d, 0) where p = q (rare but real:
    # p = q rows).
    slope0 = d @ (diff > 0)
    ties = diff == 0
    has_ties = bool(ties.any())
    if has_ties:
        slope0 += np.minimum(d, 0.0) @ ties
    # Breakpoints t = diff / d; those in (0, 1) count (p = q is set to -1: no breakpoint).
    with np.errstate(divide="ignore", invalid="ignore"):
        t = diff / d
    if has_ties:
        t[:, ties] = -1.0
    abs_d = np.abs(d)
    if vocab <= _SORT_MAX_VOCAB:
        return [0.0, 0.0] + _first_crossings_sorted(t, abs_d, slope0)
    return [0.0, 0.0] + _first_crossings_binned(t, abs_d, slope0)


def _first_crossings_sorted(t: np.ndarray, abs_d: np.ndarray, slope0: np.ndarray) -> list[float]:
    """Per row: the first breakpoint in (0, 1), in increasing ``t``, at which the running sum of the
    slope drops ``|d|`` reaches ``slope0`` (0 if ``slope0 <= 0``, 1 if never); (R, V) -> R floats.
    One sort of each row's breakpoints: the cheaper search for short rows (a cut row,
    :func:`host_node_weights`), where the cost is numpy's fixed cost per call (array methods: the
    ``np.*`` wrappers add 2-4 us each here)."""
    valid = (t > 0.0) & (t < 1.0)  # (NaN compares False)
    lams = []
    for row, slope in enumerate(slope0.tolist()):
        if slope <= 0.0:
            lams.append(0.0)
            continue
        members = valid[row].nonzero()[0]
        lams.append(_crossing_among(t[row][members], abs_d[row][members], slope))
    return lams


def _crossing_among(t_m: np.ndarray, abs_d_m: np.ndarray, slope: float) -> float:
    """The first of some breakpoints, in increasing ``t``, at which the running sum of their drops
    reaches ``slope`` (1 if it never does): one sort of them."""
    order = t_m.argsort()
    hit = int(abs_d_m[order].cumsum().searchsorted(slope))  # the first running sum >= slope
    return float(t_m[order[hit]]) if hit < len(t_m) else 1.0


def _first_crossings_binned(t: np.ndarray, abs_d: np.ndarray, slope0: np.ndarray) -> list[float]:
    """:func:`_first_crossings_sorted` without sorting the rows: the breakpoints go into
    ``_WEIGHT_BINS`` equal bins of (0, 1) with their drops summed per bin (one ``bincount``); the bin
    where the running sum crosses is found from the bins' running sum, and only that bin's breakpoints
    (and one bin either side) are sorted."""
    rows_k = t.shape[0]
    # Bin 0 holds t < 0 (and p = q, t = -1), the last bin t >= 1 and x / 0; those two are never summed.
    # (NaN cannot occur: 0 / 0 needs p = q, set to -1.)
    # Bin 1 + floor(t * bins) for t in [0, 1), clipped: as a truncation of t * bins + 1 >= 0 (one pass
    # fewer than a floor; any monotone binning gives the same weight, since the crossing bin and its
    # neighbours are re-summed in t order), with each row's offset in the flat bincount added as a float.
    width = _WEIGHT_BINS + 2
    scaled = t * _WEIGHT_BINS
    scaled += 1.0
    scaled.clip(0.0, _WEIGHT_BINS + 1.0, out=scaled)
    scaled += (np.arange(rows_k) * float(width))[:, None]
    bins = scaled.astype(np.int64)
    # bincount adds in index order: the same float64 sums as torch's scatter_add_.
    drops = np.bincount(bins.reshape(-1), weights=abs_d.reshape(-1), minlength=rows_k * width)
    cum = drops.reshape(rows_k, width)[:, 1:_WEIGHT_BINS + 1].cumsum(-1)  # (K-1, bins): t-bins only
    lams = []
    for row, slope in enumerate(slope0.tolist()):
        if slope <= 0.0:
            lams.append(0.0)
            continue
        if cum[row, -1] < slope:  # the slope stays positive up to 1 (the bin sums are exact upper
            lams.append(1.0)      # bounds up to rounding; the crossing bin is re-summed below)
            continue
        crossing = int(np.searchsorted(cum[row], slope))  # first bin with cum >= slope
        # One bin either side: the bin sums round differently from the sorted running sum.
        start, stop = max(crossing - 1, 0), min(crossing + 1, _WEIGHT_BINS - 1)
        # The bins start..stop of this row: one unsigned comparison (smaller bins wrap around to huge).
        members = ((bins[row] - (row * width + 1 + start)).view(np.uint64) <= stop - start).nonzero()[0]
        before = cum[row, start - 1] if start > 0 else 0.0
        lams.append(_crossing_among(t[row][members], abs_d[row][members], slope - before))
    return lams


def host_node_weights(p64: np.ndarray, q64: np.ndarray, key: np.ndarray, num_paths: int) -> list[float]:
    """The host form's node weights at one node: (V,) float64 ``p``, ``q`` and the node's keys ->
    :func:`node_weights`' list, computed on what can move ``F``. Any weight keeps the method lossless;
    only the acceptance depends on it (``scripts/adaptive_weight_loss.py`` measures what these
    shortcuts lose against the exact weights: about 1e-9 of ``F`` at T = 0.2 and 3e-4 at T = 1 on the
    bundled pair).

    - Below V = ``BUCKET_MIN_VOCAB``: every token, with the exact ``W``.
    - A sharp row (fewer than V / 2 tokens with ``q > _WEIGHT_MASS_CUT / V``; about 150 of 4096 at
      T = 0.2 on the bundled pair) is cut to those tokens, ranked exactly among themselves. What is
      left out has q-mass ``eps <= _WEIGHT_MASS_CUT``, and each left-out term ``min(p_x, q_x + lam d_x)``
      of ``F`` lies in ``[0, n q_x]`` for every ``lam``, so the weight found loses at most ``n eps`` of
      ``F`` (and as much again through the ``W`` it ignores).
    - A flat row: its occupied key buckets (a few hundred: keys are ratios near 1) stand for its
      tokens, each with the bucket's q- and p-mass and the q-mass of the buckets below it
      (:func:`gbv.verify.ranking.occupied_bucket_masses`). Inside a bucket the keys ``p / q`` agree
      to 1/16, so its tokens' breakpoints nearly coincide, and a bucket holding one token is that token.
    """
    vocab = q64.shape[-1]
    if vocab < ranking.BUCKET_MIN_VOCAB:  # (looked up at call time: the tests force the paths below)
        below = mass_below_rows(torch.from_numpy(key)[None], torch.from_numpy(q64)[None])[0].numpy()
        return node_weights(p64, q64, below, num_paths)
    support = (q64 > _WEIGHT_MASS_CUT / vocab).nonzero()[0]
    if 2 * len(support) < vocab:
        q_cut = q64[support]
        return node_weights(p64[support], q_cut, mass_below_among(key[support], q_cut), num_paths)
    mass_q, mass_p, below = occupied_bucket_masses(key, q64, p64)
    return node_weights(mass_p, mass_q, below, num_paths)


def node_weights_on_device(p64: Tensor, q64: Tensor, below: Tensor, num_paths: int) -> Tensor:
    """:func:`node_weights` as tensor code without a host read: (V,) float64 rows -> (K,) float64,
    ``lam_n`` at index ``n - 1`` (``lam_1 = 0``). The same smallest maximiser of ``F``, found by one
    sort of each row's breakpoints in (0, 1) instead of bins (the bins need a read to pick the
    crossing bin): ``lam_n`` is the first breakpoint at which the summed slope drops reach the right
    slope at 0, 0 if that slope is not positive, 1 if the drops never reach it.
    """
    if num_paths == 1:
        return q64.new_zeros(1)
    # d_n = q (S_n(W + q, W) - 1) for n = 2..K, as in node_weights.
    x, s_n, x_pow, rows = below + q64, torch.ones_like(q64), torch.ones_like(q64), []
    for _ in range(num_paths - 1):
        x_pow = x_pow * x
        s_n = torch.addcmul(x_pow, s_n, below)  # S_{n+1} = W S_n + x^n
        rows.append(s_n)
    d = torch.stack(rows).sub_(1.0).mul_(q64)  # (K-1, V)
    diff = p64 - q64
    ties = diff == 0
    slope0 = d @ (diff > 0).to(d.dtype) + d.clamp_max(0.0) @ ties.to(d.dtype)  # right slope at 0, (K-1,)
    t = diff / d
    valid = (t > 0) & (t < 1) & ~ties  # breakpoints in (0, 1) (NaN compares False)
    t_sorted, order = torch.sort(torch.where(valid, t, math.inf), dim=-1)
    dropped = torch.where(valid, d.abs(), 0.0).gather(-1, order).cumsum(-1)  # slope lost up to each breakpoint
    reached = dropped >= slope0.unsqueeze(-1)  # grows only at breakpoints, so the first hit is one
    first = reached.to(torch.uint8).argmax(-1, keepdim=True)
    lam = torch.where(reached.any(-1), t_sorted.gather(-1, first).squeeze(-1), 1.0)
    return torch.cat([q64.new_zeros(1), torch.where(slope0 > 0, lam, 0.0)])


def choose_next(candidates: list[int], keys: list[float], lam: float, rng: RandomSource) -> int:
    """The selection step at a node: with probability ``lam`` the best-ranked of the candidates' next
    tokens (largest key, ties -> smaller id), else the lowest-index candidate's. The coin is drawn only
    where the two differ (where they agree it cannot change anything)."""
    best = best_token(candidates, keys)
    if best == candidates[0]:
        return best
    return best if rng.accept(lam) else candidates[0]


def update_counts(counts: list[float], lams: list[float], q_s: float, below_s: float) -> list[float]:
    """``a(k) <- sum_n a(n) M_n(s, k)`` for the selected token ``s``, renormalised.

    ``counts[n]``, ``lams[n]`` for ``n = 0..K`` (index 0 unused); ``Kg_n(s, k) = C(n, k) q^k W^(n-k)``
    (the best-ranked of n draws is ``s`` and exactly k drew it), ``Ku_n(s, k) = C(n-1, k-1) q^k
    (1 - q)^(n-k)`` (the first candidate drew ``s`` and k-1 others did too).
    """
    num_paths = len(counts) - 1
    new = [0.0] * (num_paths + 1)
    for n in range(1, num_paths + 1):
        if counts[n] == 0.0:
            continue
        lam = lams[n]
        for k in range(1, n + 1):
            kg = comb(n, k) * q_s ** k * below_s ** (n - k)
            ku = comb(n - 1, k - 1) * q_s ** k * (1.0 - q_s) ** (n - k)
            new[k] += counts[n] * (lam * kg + (1.0 - lam) * ku)
    total = sum(new)
    return [c / total for c in new] if total > 0.0 else counts


@dataclass
class AdaptiveLaw:
    """``q_A`` at the nodes of the selected path: ``q_A(y) = q_y R(W_y, q_y)`` with
    ``R = sum_n abar(n) (lam_n S_n(W + q, W) + 1 - lam_n)``, non-decreasing in ``W``. Implements
    :class:`gbv.verify.ranking.RankLaw` (``row`` = node index); ``counts``, ``lams`` are (N, K) float64,
    column ``n - 1`` for ``n`` paths sharing the prefix, ``counts`` normalised per row."""

    counts: Tensor
    lams: Tensor

    def _ratio(self, row: Tensor, x: Tensor, z: Tensor) -> Tensor:
        """``R = sum_n a(n) (1 - lam_n) + sum_n a(n) lam_n S_n(x, z)`` (tensors, or the on_host copy's
        arrays): the constant part summed once per row, then one term per ``n >= 2`` (``S_1 = 1``),
        so a call on a few tokens is a dozen small operations."""
        counts, lams = self.counts[row], self.lams[row]  # (..., K)
        greedy = counts * lams
        # counts (1 - lams), not counts - greedy: the latter loses (1 - lam)'s digits where lam ~ 1.
        total = (counts * (1.0 - lams)).sum(-1) + greedy[..., 0]
        if self.counts.shape[-1] == 1:
            return total + 0.0 * x  # (x's shape)
        x_pow, s_n = x, z + x  # x^1, S_2
        total = total + greedy[..., 1] * s_n
        for n in range(3, self.counts.shape[-1] + 1):  # S_n = z S_{n-1} + x^(n-1)
            x_pow = x_pow * x
            s_n = s_n * z + x_pow
            total = total + greedy[..., n - 1] * s_n
        return total

    def token_law(self, row: Tensor, below: Tensor, q: Tensor) -> Tensor:
        return q * self._ratio(row, below + q, below)

    def block_law(self, row: Tensor, below: Tensor, mass: Tensor) -> Tensor:
        return self.token_law(row, below, mass)  # a contiguous run of the order telescopes like one token

    def ratio_bounds(self, row: Tensor, low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
        return self._ratio(row, low, low), self._ratio(row, high, high)  # S_n(x, z) in [S_n(z, z), S_n(x, x)]

    def compiled_law(self, row: int) -> tuple[int, int, np.ndarray]:
        # R's constant part as _ratio sums it (numpy's sum over the K columns), then the g_n of n >= 2
        counts, lams = self.counts[[row]], self.lams[[row]]
        greedy = counts * lams
        constant = (counts * (1.0 - lams)).sum(-1) + greedy[..., 0]
        return 1, counts.shape[-1], np.concatenate([constant, greedy[0, 1:]]).astype(np.float64)

    def on_host(self) -> "AdaptiveLaw":
        """The same law over numpy arrays (:class:`gbv.verify.ranking.RankLaw`)."""
        if isinstance(self.counts, np.ndarray):
            return self
        return AdaptiveLaw(host_array(self.counts), host_array(self.lams))

    def on_tensors(self) -> "AdaptiveLaw":
        """The same law over CPU tensors (:class:`gbv.verify.ranking.RankLaw`)."""
        if isinstance(self.counts, Tensor):
            return self
        return AdaptiveLaw(torch.from_numpy(self.counts), torch.from_numpy(self.lams))


def _select_per_node(tokens: list[list[int]], q_host: np.ndarray, p_host: np.ndarray, key_rows: np.ndarray | None,
                     num_paths: int, block_len: int, rng: RandomSource) -> tuple:
    """verify_gbv_adaptive's top-down selection, a node at a time: ``(path, leads, keys, counts rows,
    weight rows, law on path, p on path)``. ``key_rows`` (L, V) float32 where the compiled per-node calls
    run (they write each node's keys there), else None (numpy)."""
    vocab = q_host.shape[-1]
    kernels = common.compiled_kernels
    compiled = key_rows is not None
    alive = list(range(num_paths))
    counts = [0.0] * (num_paths + 1)
    counts[num_paths] = 1.0
    leads, keys, counts_rows, lams_rows, law_on, p_on = [], [], [], [], [], []
    for depth in range(block_len):
        lead = alive[0]
        q_row, p_row = q_host[lead, depth], p_host[lead, depth]
        # The weights may be any function of the node's rows: they use W from key buckets at large V
        # (no sort) and leave out tokens of negligible q, while the law below uses the exact W
        # wherever it is evaluated.
        if compiled:
            key = key_rows[depth]
            lams = kernels.adaptive_node(p_row, q_row, key, num_paths, _WEIGHT_MASS_CUT / vocab)
        else:
            key = ranking_key(p_row, q_row)
            lams = host_node_weights(p_row.astype(np.float64), q_row.astype(np.float64), key, num_paths)
        candidates = [tokens[k][depth] for k in alive]
        chosen = choose_next(candidates, key[candidates].tolist(), lams[len(alive)], rng)
        alive = [k for k in alive if tokens[k][depth] == chosen]
        leads.append(lead)
        keys.append(key)
        counts_rows.append(counts[1:])
        lams_rows.append(lams[1:])
        if compiled and num_paths <= 32:  # the same float operations as below, in one call
            _, _, p_s, law_s, counts = kernels.adaptive_step(key, q_row, False, p_row, chosen, counts, lams)
            law_on.append(law_s)
            p_on.append(p_s)
            continue
        below_s = float(mass_below_array(key[None], q_row[None], [chosen])[0])
        q_s, p_s = float(q_row[chosen]), float(p_row[chosen])
        # q_A(s) = q_s sum_n abar(n) (lam_n S_n(W + q, W) + 1 - lam_n); counts are normalised.
        # (1 - lam) in brackets: lam S + 1 - lam would cancel S when it is tiny.
        ratio = sum(counts[n] * (lams[n] * power_sum(below_s + q_s, below_s, n) + (1.0 - lams[n]))
                    for n in range(1, num_paths + 1) if counts[n] > 0.0)
        law_on.append(q_s * ratio)
        p_on.append(p_s)
        counts = update_counts(counts, lams, q_s, below_s)
    return alive[0], leads, keys, counts_rows, lams_rows, law_on, p_on


def verify_gbv_adaptive(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """gbv-adaptive: (K, L) long tokens, (K, L, V) q, (K, L+1, V) p -> :class:`VerifyResult`.

    Top-down selection with the node weights, the law ``q_A`` of the selected path along it, then BV
    on that path with ``p`` and ``q_A``. The candidates alive at a depth share the selected prefix, so
    the node's rows are read from the lowest-index one (the path finally selected is the lowest-index
    survivor, so these are its rows). ``K = 1`` is BV (``q_A = q`` up to rounding).
    """
    if uses_device_form(p):  # one host read instead of ~100: see verify_gbv_adaptive_on_device
        return verify_gbv_adaptive_on_device(draft_tokens, q, p, rng)
    num_paths, block_len, _ = check_shapes(draft_tokens, q, p)
    if num_paths == 1:  # one path: nothing to select, q_A = q; BV on the inputs as given, bit for bit
        return VerifyResult(0, *block_verify_path(draft_tokens[0], q[0], p[0], rng))
    # The per-node work runs on numpy views of the rows (the host form runs on the CPU, where numpy's
    # fixed cost per call is a fifth of torch's and dominates rows of a few thousand). Each node's rows
    # are converted on their own: a float64 copy of all K L rows at once is a fresh allocation large
    # enough to be page-faulted in on every call.
    q_host, p_host = host_array(q), host_array(p)
    vocab = q_host.shape[-1]
    kernels = common.compiled_kernels
    # From V = BUCKET_MIN_VOCAB up, float32 rows (the engine's) take one compiled call per node for its
    # keys and weights (host_node_weights' cuts, the same weights): ~10 numpy calls and two float64
    # copies of the rows, ~0.1 ms a node right after a forward.
    compiled = (kernels is not None and vocab >= ranking.BUCKET_MIN_VOCAB and q_host.dtype == np.float32
                and p_host.dtype == np.float32 and q_host.flags.c_contiguous and p_host.flags.c_contiguous)
    key_rows = np.empty((block_len, vocab), dtype=np.float32) if compiled else None
    select = getattr(kernels, "adaptive_select", None) if compiled and FUSED_SELECTION and num_paths <= 32 else None
    if select is not None:  # _select_per_node's loop in one call, the same bits and coins
        path, leads, counts_rows, lams_rows, law_on, p_on = select(
            q_host, p_host, np.ascontiguousarray(host_array(draft_tokens), dtype=np.int64), key_rows, num_paths,
            block_len, vocab, _WEIGHT_MASS_CUT / vocab, rng.accept)
        keys = None
    else:
        path, leads, keys, counts_rows, lams_rows, law_on, p_on = _select_per_node(
            draft_tokens.tolist(), q_host, p_host, key_rows, num_paths, block_len, rng)
    law = AdaptiveLaw(np.array(counts_rows, dtype=np.float64), np.array(lams_rows, dtype=np.float64))
    # The selected nodes' rows, (L, V): the lead path's at each depth (numpy, as the nodes' rows above).
    # Where the selected path led at every depth (path 0 survived: the common case) they are its own
    # rows, taken as views: two (L, V) copies cost ~15 us right after a forward here.
    if leads.count(path) == block_len:
        q_all, p_all = q_host[path], p_host[path, :block_len]
    else:
        node_rows = (np.array(leads), np.arange(block_len))
        q_all, p_all = q_host[node_rows], p_host[node_rows]
    key_all = key_rows if compiled else np.stack(keys)

    def residual_bounds(rows: list[int], weights: list[float]) -> MassBounds:
        return residual_bounds_ranked(key_all, q_all, p_all, rows, weights, law)

    def residual_dist(i: int, w: float) -> Tensor:
        return residual_row(key_all[i], q_all[i], p_all[i], w, law, i)

    ratios = path_ratios(p_on, law_on)
    # p_L of the path, a view of the numpy rows where they are p's own (torch's indexing costs more)
    bonus = p[path, block_len] if p.dtype == torch.bfloat16 else torch.from_numpy(p_host[path, block_len])
    accepted_len, next_token = block_verify_core(ratios, residual_bounds, residual_dist, bonus, rng)
    return VerifyResult(path, accepted_len, next_token)


@functools.lru_cache(maxsize=None)
def _count_kernels(num_paths: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``C(n, k)``, ``C(n-1, k-1)`` and the exponents ``max(n - k, 0)`` as (K, K) float64 tables,
    row ``n - 1``, column ``k - 1`` (zero binomials where ``k > n``), for :func:`update_counts_on_device`.
    Built once per (K, device): never written to."""
    n = torch.arange(1, num_paths + 1, dtype=torch.float64)
    greedy = torch.tensor([[comb(a, b) for b in range(1, num_paths + 1)] for a in range(1, num_paths + 1)],
                          dtype=torch.float64)
    uniform = torch.tensor([[comb(a - 1, b - 1) for b in range(1, num_paths + 1)] for a in range(1, num_paths + 1)],
                           dtype=torch.float64)
    exponents = (n.unsqueeze(-1) - n).clamp_min(0.0)
    return greedy.to(device), uniform.to(device), exponents.to(device)


def update_counts_on_device(counts: Tensor, lams: Tensor, q_s: Tensor, below_s: Tensor,
                            kernels: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """:func:`update_counts` as tensor code: (K,) ``counts`` and ``lams`` (index ``n - 1``), (1,)
    ``q_s`` and ``below_s`` -> (K,) ``a(k) <- sum_n a(n) M_n(s, k)``, renormalised (kept as they
    were if the update has no mass, as in :func:`update_counts`)."""
    greedy, uniform, exponents = kernels
    k = torch.arange(1, counts.shape[0] + 1, dtype=torch.float64, device=counts.device)
    q_k = q_s ** k  # (K,): q^k, a column factor of both kernels
    mix = (lams.unsqueeze(-1) * greedy * below_s ** exponents
           + (1.0 - lams).unsqueeze(-1) * uniform * (1.0 - q_s) ** exponents) * q_k  # (K, K): M_n(s, k)
    new = counts @ mix
    total = new.sum()
    return torch.where(total > 0, new / torch.where(total > 0, total, 1.0), counts)


def verify_gbv_adaptive_on_device(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """gbv-adaptive as tensor code on the inputs' device with one host read per call
    (:func:`verify_gbv_adaptive` on a GPU). The same selection rule and law, by other means:

    the alive paths are a (K,) mask, the node's rows those of the first alive path (a ``take_row``);
    ``W`` of the whole row by one sort (:func:`gbv.verify.ranking.mass_below_rows_sorted`: exact, so
    the node weights use the exact ``W``, where the host form bins them from V = 4096 up -- any
    weight keeps the method lossless); the weights by :func:`node_weights_on_device`; the selection
    coin is always drawn, with probability 1 where the best-ranked and the first candidate's tokens
    agree (the host form draws it only where they differ: the same law); ``a(n)`` by
    :func:`update_counts_on_device`; then BV as tensor code on the full rows of ``q_A``
    (:func:`gbv.verify.block.block_verify_on_device`). The path, the accepted length and the next
    token are read back together.
    """
    num_paths, block_len, vocab = check_shapes(draft_tokens, q, p)
    if num_paths == 1:
        return VerifyResult(0, *block_verify_path(draft_tokens[0], q[0], p[0], rng))
    device = q.device
    kernels = _count_kernels(num_paths, device)
    alive = torch.ones(num_paths, dtype=torch.bool, device=device)
    counts = torch.zeros(num_paths, dtype=torch.float64, device=device)
    counts[-1] = 1.0  # a = e_K at the root
    rows_q, rows_w, counts_rows, lams_rows = [], [], [], []
    no_key = torch.tensor(-math.inf, dtype=torch.float64, device=device)
    for depth in range(block_len):
        lead = alive.to(torch.uint8).argmax()  # the first alive path: its rows are the node's
        q_row, p_row = take_row(q[:, depth], lead), take_row(p[:, depth], lead)
        q64, p64 = q_row.to(torch.float64), p_row.to(torch.float64)
        key = ranking_key(p_row, q_row)
        below = mass_below_rows_sorted(key.unsqueeze(0), q64.unsqueeze(0))[0]  # (V,) exact W
        lams = node_weights_on_device(p64, q64, below, num_paths)  # (K,)
        tokens_d = draft_tokens[:, depth]
        keys_d = torch.where(alive, key.gather(0, tokens_d).to(torch.float64), no_key)
        # The best-ranked of the alive paths' tokens: the largest key, ties -> the smaller id.
        best = torch.where(alive & (keys_d == keys_d.max()), tokens_d, vocab).min()
        first = take_row(tokens_d, lead)
        lam = take_row(lams, alive.sum() - 1)
        take_best = rng.coins(torch.where(best == first, 1.0, lam))
        chosen = torch.where(take_best, best, first)
        alive = alive & (tokens_d == chosen)
        rows_q.append(q64)
        rows_w.append(below)
        counts_rows.append(counts)
        lams_rows.append(lams)
        pick = chosen.reshape(1)
        counts = update_counts_on_device(counts, lams, q64.gather(0, pick), below.gather(0, pick), kernels)
    path = alive.to(torch.uint8).argmax()  # the lowest-index survivor
    law = AdaptiveLaw(torch.stack(counts_rows), torch.stack(lams_rows))
    rows = torch.arange(block_len, device=device).unsqueeze(-1)
    q_a = law.token_law(rows, torch.stack(rows_w), torch.stack(rows_q))  # (L, V) float64
    accepted_len, next_token = block_verify_on_device(take_row(draft_tokens, path), q_a,
                                                      take_row(p, path).to(torch.float64), rng)
    return VerifyResult(*host_ints(path, accepted_len, next_token))
