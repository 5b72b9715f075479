"""Greedy Multi-Path Block Verification, GBV (Thomas & Pal, 2026). SPEC section 3.

GBV picks one of the K i.i.d. drafted paths by a fixed, greedy, tree-based ranking of all length-L
sequences, and then runs block verification (BV, :func:`gbv.verify.block.block_verify_core`) on that
path with the draft law ``q`` replaced by the exact law ``q_G`` of the *selected* path (the "skewed
draft"). BV is lossless for any draft law it is told exactly, so GBV is lossless; the selection makes
the verified path look more like the target, which often (not on every instance: SPEC section 3, and
``gbv-adaptive`` in :mod:`gbv.verify.gbv_adaptive`) raises the accepted length as K grows.

Pipeline (shapes for one sequence; K paths, block length L, vocabulary V). The order of tokens at a
node -- key, tie-break, masses ranked below a token -- is :mod:`gbv.verify.ranking`, shared with
gbv-adaptive:

1. :func:`select_path` -- ``(K, L)`` tokens, ``(K, L, V)`` q, ``(K, L+1, V)`` p -> index of the
   highest-ranked path (lexicographic comparison, candidate filtering depth by depth).
2. :func:`path_walk` -- the scalar walk down the selected path: ``v`` (normalised q-mass of the
   current prefix block) and ``u = 1 - v`` at every node, from one masked sum per node (the q-mass
   ranked below the selected token; no sort).
3. :class:`SkewedLaw` -- ``q_G`` at a node as a function of a token's rank mass, in the stable form of
   SPEC section 3. BV needs it on the path (ratios), summed in positive parts (residual masses
   ``r_i``: :func:`gbv.verify.ranking.positive_part_mass`, bucketed, no full sort) and as one full row
   at the accepted length (the correction distribution: one sort, of the tokens that can carry
   residual mass only).
4. :func:`verify_gbv` -- BV on the selected path with ``p`` and ``q_G``.
   :func:`skewed_draft_law` returns the full ``(L, V)`` rows of ``q_G`` (tests, analysis).

Precision: ranking keys are computed in the inputs' precision (float32, or float64 for float64
inputs); ``q_G`` is computed in float64 whatever the input dtype (float32 inputs are converted
exactly), and BV then runs in float64 on the selected path.
``K = 1`` gives ``q_G = q`` exactly, and BV then runs on the inputs as given: GBV with one path is BV,
bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gbv.verify.block import block_verify_core, block_verify_on_device, block_verify_path, path_ratios
from gbv.verify import common
from gbv.verify.common import (RandomSource, VerifyResult, check_shapes, host_ints, take_row,
                               uses_device_form)
from gbv.verify.ranking import (ZERO_ZERO_KEY, MassBounds, best_token, host_array, mass_below_array,
                                mass_below_of_rows, mass_below_rows, mass_below_rows_sorted, power_sum,
                                ranking_key, residual_bounds_ranked, residual_row)

__all__ = ["ZERO_ZERO_KEY", "SkewedLaw", "path_walk", "path_walk_on_device", "ranking_key", "select_path",
           "select_path_host", "select_path_on_device", "skewed_draft_law", "skewed_law_rows_on_device",
           "skewed_walk", "verify_gbv", "verify_gbv_on_device", "walk_law_host"]


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
    division by zero even when ``p`` and ``q`` are one-hot (temperature 0). Contiguous float32 rows on
    the CPU take the compiled selection (``gbv/verify/_verify_kernels.c``: the same index).
    """
    num_paths, block_len = draft_tokens.shape
    if num_paths == 1:
        return 0
    kernels = common.compiled_kernels
    if (kernels is not None and p.device.type == "cpu" and q.dtype == torch.float32 and p.dtype == torch.float32
            and q.is_contiguous() and p.is_contiguous() and num_paths <= 64):
        # One compiled call: the same float32 keys, compared in the same order (select_path_host is
        # about ten numpy calls and Python loops, ~0.2 ms right after a forward).
        tokens = np.ascontiguousarray(host_array(draft_tokens), dtype=np.int64)
        return kernels.select_path(tokens, q.numpy(), p.numpy(), num_paths, block_len, p.shape[1], p.shape[2])
    tokens = host_array(draft_tokens)
    return select_path_host(tokens, _on_path(q, draft_tokens, tokens), _on_path(p, draft_tokens, tokens))


def _on_path(rows: Tensor, tokens: Tensor, tokens_h: np.ndarray) -> np.ndarray:
    """(K, L') rows at (K, L) tokens -> (K, L) host values ``rows[k, d, tokens[k, d]]``: read from a
    numpy view on the CPU, gathered on the device elsewhere (one host copy of K * L values)."""
    if rows.device.type == "cpu":
        num_paths, block_len = tokens_h.shape
        return host_array(rows)[np.arange(num_paths)[:, None], np.arange(block_len), tokens_h]
    return host_array(rows[:, :tokens.shape[1]].gather(-1, tokens.unsqueeze(-1)).squeeze(-1))


def select_path_host(tokens: np.ndarray, on_q: np.ndarray, on_p: np.ndarray) -> int:
    """:func:`select_path` from the host values it needs: (K, L) token ids and each path's own
    ``q`` and ``p`` at its own tokens (:func:`ranking_key` of numpy arrays: the same IEEE divisions as
    of tensors)."""
    num_paths, block_len = tokens.shape
    token_rows = tokens.tolist()
    keys = ranking_key(on_p, on_q).astype(np.float64).tolist()
    alive = list(range(num_paths))
    for depth in range(block_len):
        if len(alive) == 1:
            break
        best = best_token([token_rows[k][depth] for k in alive], [keys[k][depth] for k in alive])
        alive = [k for k in alive if token_rows[k][depth] == best]
    return alive[0]


def select_path_on_device(draft_tokens: Tensor, q: Tensor, p: Tensor) -> Tensor:
    """:func:`select_path` as tensor code without a host read: the same index, as a 0-d long tensor.

    Every pair of paths ``(a, b)`` is compared at the first depth where their tokens differ (the two
    tokens share a node there, so their keys are comparable): ``a`` beats ``b`` by a larger key, or an
    equal key and a smaller token id. The lexicographic maximum is beaten by no path, every other
    path by it, so the smallest index beaten by none is :func:`select_path`'s answer. ``O(K^2 L)``
    comparisons in a fixed number of tensor calls, instead of a depth loop on the host.
    """
    num_paths, block_len = draft_tokens.shape
    device = draft_tokens.device
    if num_paths == 1:
        return torch.zeros((), dtype=torch.long, device=device)
    path_ids = torch.arange(num_paths, device=device).unsqueeze(-1)
    depth_ids = torch.arange(block_len, device=device)
    key = ranking_key(p[path_ids, depth_ids, draft_tokens], q[path_ids, depth_ids, draft_tokens])  # (K, L)
    differs = draft_tokens.unsqueeze(1) != draft_tokens.unsqueeze(0)  # (K, K, L): [a, b, depth]
    first = differs.to(torch.uint8).argmax(-1)  # (K, K) first differing depth (argmax: the first maximum)
    key_a, token_a = key.gather(1, first), draft_tokens.gather(1, first)  # [a, b] = path a's at first[a, b]
    # first is symmetric, so path b's values at first[a, b] are the transposes.
    key_b, token_b = key_a.transpose(0, 1), token_a.transpose(0, 1)
    beats = differs.any(-1) & ((key_a > key_b) | ((key_a == key_b) & (token_a < token_b)))
    return (~beats.any(0)).to(torch.uint8).argmax()


def path_walk(below_on: list[float], q_on: list[float]) -> tuple[list[float], list[float]]:
    """``(v, u)`` at the nodes ``s_{1:i}``, ``i = 0..L-1``, of the selected path (SPEC section 3).

    ``v`` = q-mass of the current prefix block over that of the block and everything ranked below it
    (``v = 1`` at the root), ``u = 1 - v`` carried separately. ``below_on[i]`` = q-mass ranked strictly
    below ``s_{i+1}`` at node ``i`` and ``q_on[i] = q_i(s_{i+1})``. The update
    ``v <- v q(s) / (1 - v b(s))`` is written with ``1 - v b(s) = u + v (W(s) + q(s))``, sums of
    non-negative terms only, so it stays accurate when ``b(s)`` is within rounding of 1.
    """
    v_list, u_list = [], []
    v, u = 1.0, 0.0
    for below, q_s in zip(below_on, q_on):
        v_list.append(v)
        u_list.append(u)
        x_on = u + v * (below + q_s)  # = 1 - v b(s_{i+1})
        if x_on > 0.0:
            v, u = v * q_s / x_on, (u + v * below) / x_on
        else:  # s_{i+1} has q-probability 0 (not a real draft): any v in [0, 1] keeps rows normalised
            v, u = 0.0, 1.0
    return v_list, u_list


def path_walk_on_device(below_on: Tensor, q_on: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`path_walk` as tensor code without a host read: (L,) float64 ``below_on``, ``q_on`` ->
    ``(v, u)``, (L,) float64 each, equal to the host walk's up to rounding.

    The walk's update is projective: ``(v, u)`` is proportional to ``(a, b)`` with ``a <- a q(s)`` and
    ``b <- b + a W(s)`` (``a = 1``, ``b = 0`` at the root), so ``a_i = prod_{j<i} q_j`` and
    ``b_i = sum_{j<i} a_j W_j``: a cumulative product and a cumulative sum instead of an L-step loop.
    Both are formed in logarithms (``a_i`` underflows for long blocks of unlikely tokens), and
    ``v = a / (a + b) = sigmoid(log a - log b)``, ``u = sigmoid(log b - log a)``: no subtraction of
    nearly equal masses. A prefix with ``a = 0`` (a token of q-probability 0) gets the host walk's
    ``v = 0``, ``u = 1``.
    """
    with torch.no_grad():
        log_q, log_w = torch.log(q_on), torch.log(below_on)  # -inf at 0
        log_a = torch.cat([log_q.new_zeros(1), torch.cumsum(log_q, 0)[:-1]])
        log_b = torch.cat([log_q.new_full((1,), -math.inf), torch.logcumsumexp(log_a + log_w, 0)[:-1]])
        dead = log_a == -math.inf
        diff = torch.where(dead, 0.0, log_a - log_b)  # +inf where b = 0 (v = 1, u = 0)
        return torch.where(dead, 0.0, torch.sigmoid(diff)), torch.where(dead, 1.0, torch.sigmoid(-diff))


@dataclass
class SkewedLaw:
    """``q_G`` at the nodes of the selected path: ``q_G(y) = q(y) S_K(u + v (W + q), u + v W) / S_K(1, u)``.

    ``W`` = q-mass ranked strictly below ``y``; ``v``, ``u`` from :func:`path_walk` (one entry per node);
    ``S_K`` = :func:`gbv.verify.ranking.power_sum`. Implements :class:`gbv.verify.ranking.RankLaw`
    (``row`` = index into ``v``/``u``), so BV's residual masses need no full sort.
    """

    v: Tensor  # (N,) float64 (numpy arrays in the on_host copy)
    u: Tensor  # (N,) float64
    num_paths: int

    def __post_init__(self) -> None:
        self.denom = power_sum(1.0, self.u, self.num_paths)  # S(0, v) = sum_j u^j >= 1

    def on_host(self) -> "SkewedLaw":
        """The same law over numpy arrays (:class:`gbv.verify.ranking.RankLaw`)."""
        if isinstance(self.v, np.ndarray):
            return self
        return SkewedLaw(host_array(self.v), host_array(self.u), self.num_paths)

    def on_tensors(self) -> "SkewedLaw":
        """The same law over CPU tensors (:class:`gbv.verify.ranking.RankLaw`)."""
        if isinstance(self.v, Tensor):
            return self
        return SkewedLaw(torch.from_numpy(self.v), torch.from_numpy(self.u), self.num_paths)

    def token_law(self, row: Tensor, below: Tensor, q: Tensor) -> Tensor:
        v, u = self.v[row], self.u[row]
        return q * power_sum(u + v * (below + q), u + v * below, self.num_paths) / self.denom[row]

    def block_law(self, row: Tensor, below: Tensor, mass: Tensor) -> Tensor:
        return self.token_law(row, below, mass)  # a contiguous run of the order telescopes like one token

    def compiled_law(self, row: int) -> tuple[int, int, np.ndarray]:
        return 0, self.num_paths, np.array([self.v[row], self.u[row], self.denom[row]], dtype=np.float64)

    def ratio_bounds(self, row: Tensor, low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
        v, u, k = self.v[row], self.u[row], self.num_paths  # S_K(x, z) lies in [K z^(K-1), K x^(K-1)]
        return k * (u + v * low) ** (k - 1) / self.denom[row], k * (u + v * high) ** (k - 1) / self.denom[row]


def skewed_draft_law(selected_tokens: Tensor, q_path: Tensor, p_path: Tensor, num_paths: int) -> Tensor:
    """Conditionals ``q_G`` of the selected path's law along that path, full rows (SPEC section 3).

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
    ``x = 1 - v b(y) = u + v (W(y) + q(y))`` and ``z = u + v W(y)``: sums of non-negative terms only.
    Not on the verifier's hot path (it sorts every node); :func:`verify_gbv` uses the same law.
    """
    block_len = q_path.shape[0]
    q64 = q_path.to(torch.float64)
    if num_paths == 1:
        return q64.clone()  # S = 1: the selected path is the only path, q_G = q exactly
    key = ranking_key(p_path[:block_len], q_path)
    tokens = selected_tokens.reshape(block_len).to(key.device)
    law = _walk_law(key, q64, tokens, num_paths)
    rows = torch.arange(block_len, device=key.device).unsqueeze(-1)
    return law.token_law(rows, mass_below_rows(key, q64), q64)


def _walk_law(key: Tensor, q64: Tensor, tokens: Tensor, num_paths: int) -> SkewedLaw:
    """The :class:`SkewedLaw` of the selected path as tensors on the rows' device
    (:func:`walk_law_host`)."""
    law = walk_law_host(host_array(key), host_array(q64), host_array(tokens).reshape(-1), num_paths)[0]
    return SkewedLaw(torch.tensor(law.v, dtype=torch.float64, device=key.device),
                     torch.tensor(law.u, dtype=torch.float64, device=key.device), num_paths)


def walk_law_host(key: np.ndarray, q_path: np.ndarray, tokens: np.ndarray, num_paths: int
                  ) -> tuple[SkewedLaw, list[float]]:
    """The :class:`SkewedLaw` of the selected path over numpy arrays, and its on-path values
    ``q_G(s_{i+1})``: (L, V) keys and q (any float dtype; summed in float64) along the path, (L,)
    tokens; one masked sum per node (:func:`gbv.verify.ranking.mass_below_array`)."""
    return skewed_walk(mass_below_array(key, q_path, tokens.tolist()).tolist(),
                       q_path[np.arange(tokens.shape[0]), tokens].astype(np.float64).tolist(), num_paths)


def skewed_walk(below_on: list[float], q_on: list[float], num_paths: int) -> tuple[SkewedLaw, list[float]]:
    """:func:`walk_law_host` from the on-path values: ``W`` and ``q`` at each node's token (floats)."""
    v, u = path_walk(below_on, q_on)
    law = SkewedLaw(np.array(v, dtype=np.float64), np.array(u, dtype=np.float64), num_paths)
    # S_K(1, u) in Python floats: the same float64 operations as law.denom.
    on_path = [q_s * power_sum(u_i + v_i * (w + q_s), u_i + v_i * w, num_paths) / power_sum(1.0, u_i, num_paths)
               for q_s, w, v_i, u_i in zip(q_on, below_on, v, u)]
    return law, on_path


def verify_gbv(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """GBV: (K, L) long tokens, (K, L, V) q, (K, L+1, V) p -> :class:`VerifyResult`.

    Select the highest-ranked path, walk it for the law ``q_G`` of the selected path, and run BV on it
    with ``p`` and ``q_G`` (weights, residual masses and the residual all use ``q_G``), in float64.
    Returns the selected path's index, the accepted length and the next token. With ``K = 1``,
    ``q_G = q`` and BV runs on the inputs as given, so the result is exactly BV's. Temperature 0
    (one-hot ``p`` and ``q``) reduces to the longest drafted prefix matching the target's argmax,
    then its argmax.
    """
    if uses_device_form(p):  # one host read instead of ~9: see verify_gbv_on_device
        return verify_gbv_on_device(draft_tokens, q, p, rng)
    num_paths, block_len, _ = check_shapes(draft_tokens, q, p)
    path = select_path(draft_tokens, q, p)
    if num_paths == 1:
        accepted_len, next_token = block_verify_path(draft_tokens[path], q[path], p[path], rng)
        return VerifyResult(path, accepted_len, next_token)
    # The host form: numpy views of the selected path's rows (CPU tensors; a torch call costs 5-10 us
    # of fixed cost on these rows, a numpy call about a fifth of that).
    tokens, q_path, p_path = host_array(draft_tokens[path]), host_array(q[path]), host_array(p[path])
    # The keys (ranking_key: float32 for float32 rows) are computed where they are compared: along the
    # path by the masked sums, and at the nodes BV's residual reaches (no (L, V) key array).
    token_list = tokens.tolist()
    depths = np.arange(block_len)
    law, q_g_on = skewed_walk(mass_below_of_rows(p_path[:block_len], q_path, token_list).tolist(),
                              q_path[depths, tokens].astype(np.float64).tolist(), num_paths)
    p_on = p_path[depths, tokens].astype(np.float64).tolist()
    ratios = path_ratios(p_on, q_g_on)

    def residual_bounds(rows: list[int], weights: list[float]) -> MassBounds:
        return residual_bounds_ranked(None, q_path, p_path, rows, weights, law)

    def residual_dist(i: int, w: float) -> Tensor:
        return residual_row(ranking_key(p_path[i], q_path[i]), q_path[i], p_path[i], w, law, i)

    # The bonus row as given (float32 rows sample faster; its law is p_L either way).
    accepted_len, next_token = block_verify_core(ratios, residual_bounds, residual_dist, p[path, block_len], rng)
    return VerifyResult(path, accepted_len, next_token)



def verify_gbv_on_device(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """GBV as tensor code on the inputs' device with one host read per call (:func:`verify_gbv` on
    a GPU). Same law as the lazy host walk, by other means:

    :func:`select_path_on_device` (all pairwise comparisons at once), full rows of ``W`` by one sort
    per node (:func:`gbv.verify.ranking.mass_below_rows_sorted`), :func:`path_walk_on_device` (a
    cumulative product and sum), the full ``(L, V)`` rows of ``q_G``, and BV as tensor code on them
    (:func:`gbv.verify.block.block_verify_on_device`: the stop decisions as independent coins, the
    next token by inverse CDF), in float64. The path, the accepted length and the next token are read
    back together. Why two forms: on a GPU a host read stalls the pipeline and a sort of ``L`` rows
    is cheap; on this CPU the sorts made the call 1.8-1.9x the lazy host form's time at V = 32000, and
    slower in the engine at V = 4096, while a read costs ~2 us (scripts/bench_device_forms.py). The
    exact enumeration proves both lossless (tests/verify/test_gbv.py).
    """
    num_paths, block_len, _ = check_shapes(draft_tokens, q, p)
    if num_paths == 1:
        return VerifyResult(0, *block_verify_path(draft_tokens[0], q[0], p[0], rng))
    path = select_path_on_device(draft_tokens, q, p)
    tokens, p_path = take_row(draft_tokens, path), take_row(p, path)
    q_g = skewed_law_rows_on_device(tokens, take_row(q, path), p_path, num_paths)  # (L, V) float64
    accepted_len, next_token = block_verify_on_device(tokens, q_g, p_path.to(torch.float64), rng)
    return VerifyResult(*host_ints(path, accepted_len, next_token))


def skewed_law_rows_on_device(selected_tokens: Tensor, q_path: Tensor, p_path: Tensor, num_paths: int) -> Tensor:
    """:func:`skewed_draft_law` without a host read (the rows :func:`verify_gbv_on_device` verifies
    with): (L,) tokens, (L, V) q and (L+1, V) p along the selected path -> (L, V) float64 ``q_G``.

    One sort per node for ``W`` (:func:`gbv.verify.ranking.mass_below_rows_sorted`, from the very keys
    the selection compared: :func:`ranking_key` of the inputs as given) and the walk by
    :func:`path_walk_on_device`.
    """
    block_len = q_path.shape[0]
    q64 = q_path.to(torch.float64)
    if num_paths == 1:
        return q64.clone()
    below = mass_below_rows_sorted(ranking_key(p_path[:block_len], q_path), q64)  # (L, V)
    on = selected_tokens.reshape(block_len, 1)
    v, u = path_walk_on_device(below.gather(-1, on).squeeze(-1), q64.gather(-1, on).squeeze(-1))
    rows = torch.arange(block_len, device=q_path.device).unsqueeze(-1)
    return SkewedLaw(v, u, num_paths).token_law(rows, below, q64)
