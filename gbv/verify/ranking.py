"""The order of tokens at a node, shared by GBV and gbv-adaptive (SPEC sections 3 and 11).

One implementation of the ranking serves both verifiers and every place inside them (selection, the
law of the selected path, BV's residual masses): the key of :func:`ranking_key` (larger is better)
with ties broken by the *smaller token id*. Everything the two laws need from the order is the
q-mass ranked strictly below a token, ``W(y)``:

- on the path, for one token per node: :func:`mass_below`, one masked sum (no sort);
- for whole rows, where BV's residual distribution needs every token: :func:`mass_below_rows`, one
  sort over the support of ``q`` (tokens with ``q = 0`` carry no mass and need no rank);
- for BV's residual *masses* ``sum_x (w p(x) - law(x))+``, which only need a sum:
  :func:`positive_part_mass` groups tokens into key buckets (ranges of the key's float32 bits, so
  each bucket is a contiguous run of the order) and sorts only the buckets where the sign of
  ``w p - law`` is not settled by the bucket's bounds.

Shapes: ``(N, V)`` rows (N nodes), ``(N,)`` tokens; masses are float64.

The host forms (the CPU) run the per-node and bucket code on numpy views of the rows
(:func:`host_array`; laws as their :meth:`RankLaw.on_host` copies): at V of a few thousand most of a
torch call's time is its fixed cost (5-10 us), numpy's is about a fifth of that. The device forms
keep tensor code (:func:`mass_below_rows_sorted` and the verifiers' ``*_on_device`` functions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from gbv.verify import common


# Key of tokens with p(x) = q(x) = 0: below every real ratio (ratios are >= 0). Such tokens carry no
# q-mass, so where they sit changes neither the laws nor any drafted path's rank; the value only makes
# the order total and deterministic (and avoids computing 0/0).
ZERO_ZERO_KEY = -1.0

# On CPU, vocabularies larger than this are sorted with numpy (several times faster than torch's
# stable sort for V ~ 1e5); both give the same order.
_NUMPY_SORT_MIN_VOCAB = 2048

# Key buckets of positive_part_mass: the float32 bits of a key >= 0, shifted right by this much
# (8 exponent bits and 4 mantissa bits remain: each bucket spans a key ratio of at most 1 + 1/16).
_BUCKET_SHIFT = 19
_NUM_BUCKETS = (0x7F800000 >> _BUCKET_SHIFT) + 1  # up to +inf
# Below this vocabulary, positive_part_mass ranks whole rows: the buckets' fixed cost would dominate.
BUCKET_MIN_VOCAB = 4096
# float64 keys are bucketed by their float32 rounding (monotone); bounds are widened by this factor.
_KEY_MARGIN = 1e-6


def ranking_key(p: Tensor, q: Tensor) -> Tensor:
    """Per-token ranking key at a node, elementwise: larger = better. Any shape in, same shape out
    (tensors, or numpy arrays).

    ``p / q`` where ``q > 0``; ``+inf`` where ``q = 0 < p`` (the draft can never propose it, the target
    wants it); :data:`ZERO_ZERO_KEY` where ``p = q = 0``. Ties (equal keys) are broken by the smaller
    token id by every caller. Computed in float64 when an input is float64, else in float32 (the
    precision of the inputs; any fixed ranking keeps GBV lossless, and float32 keys sort faster).
    Why one function: the losslessness proof needs the law of the selected path to be computed from
    the very keys the selection compared; being elementwise, the key of a token does not depend on
    which other tokens it is computed with.
    """
    if isinstance(p, np.ndarray):  # numpy rows (the host forms' per-node code): the same IEEE divisions
        dtype = np.float64 if np.float64 in (p.dtype, q.dtype) else np.float32
        # (over: p / q past float32's range for a tiny q is +inf, as torch gives it: a fixed ranking)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            key = p.astype(dtype, copy=False) / q.astype(dtype, copy=False)
        np.putmask(key, np.isnan(key), ZERO_ZERO_KEY)  # (np.nan_to_num takes 2.5x as long)
        return key
    dtype = torch.float64 if torch.float64 in (p.dtype, q.dtype) else torch.float32
    # p / 0 is +inf for p > 0 (IEEE), the key wanted; only 0 / 0 (NaN) needs replacing. Two elementwise
    # passes and no host read (a where over a bool mask costs 10x a division on CPU).
    return torch.nan_to_num(p.to(dtype) / q.to(dtype), nan=ZERO_ZERO_KEY, posinf=math.inf)


def best_token(tokens: list[int], keys: list[float]) -> int:
    """The best-ranked of some tokens of one node, given their keys: largest key, ties -> smaller id."""
    return min(zip(tokens, keys), key=lambda tk: (-tk[1], tk[0]))[0]


def mass_below(key: Tensor, q64: Tensor, tokens: Tensor) -> Tensor:
    """q-mass ranked strictly below each given token: (N, V) keys, (N, V) float64 q, (N,) -> (N,) float64.

    One masked sum per row: tokens with a smaller key, or an equal key and a larger id. Computed with
    numpy (on the CPU copy where the rows live elsewhere): the host forms call this once per node with
    V-sized rows, where torch's fixed cost per call (5-10 us, plus a bool-to-float pass) is most of the
    time; numpy's is about 1 us (:func:`mass_below_array`).
    """
    rows = mass_below_array(host_array(key), host_array(q64).astype(np.float64, copy=False),
                            tokens.reshape(-1).tolist())
    return torch.from_numpy(rows).to(q64.device)


def mass_below_array(key: np.ndarray, q64: np.ndarray, tokens: list[int]) -> np.ndarray:
    """:func:`mass_below` on arrays: (N, V) keys, (N, V) float64 q, N token ids -> (N,) float64. The
    compiled form (:data:`gbv.verify.common.compiled_kernels`; float32 keys, q float32 or float64) sums
    in four interleaved running sums in one pass per row, where numpy's dot product sums in its own
    order: the same value up to the last bits."""
    out = np.empty(len(tokens), dtype=np.float64)
    kernels = common.compiled_kernels
    if (kernels is not None and key.dtype == np.float32 and q64.dtype in (np.float32, np.float64)
            and key.flags.c_contiguous and q64.flags.c_contiguous):
        rows, vocab = key.shape
        kernels.mass_below_at(key, q64, q64.dtype == np.float64, np.asarray(tokens, dtype=np.int64), out,
                                       rows, vocab)
        return out
    q64 = q64.astype(np.float64, copy=False)  # (the dot products below sum in q's precision)
    for row, token in enumerate(tokens):
        # Ranked below y: a smaller key, or an equal key and a larger id ("<" left of y, "<=" right).
        k_tok = key[row, token]
        below = key[row] < k_tok
        below[token + 1:] |= key[row, token + 1:] == k_tok
        out[row] = q64[row] @ below  # q * 1 = q, q * 0 = 0: the sum of the masked q
    return out


def mass_below_of_rows(p: np.ndarray, q: np.ndarray, tokens: list[int]) -> np.ndarray:
    """:func:`mass_below_array` of the keys :func:`ranking_key` ``(p, q)``: (N, V) rows, N token ids ->
    (N,) float64. The compiled form (float32 rows) computes each key where it compares it, the same
    division, so the same sums without the (N, V) key array (~0.1 ms an iteration after a forward)."""
    kernels = common.compiled_kernels
    if (kernels is not None and p.dtype == np.float32 and q.dtype == np.float32 and p.flags.c_contiguous
            and q.flags.c_contiguous):
        out = np.empty(len(tokens), dtype=np.float64)
        rows, vocab = q.shape
        kernels.mass_below_keyed(p, q, np.asarray(tokens, dtype=np.int64), out, rows, vocab)
        return out
    return mass_below_array(ranking_key(p, q), q, tokens)


def host_array(t: Tensor | np.ndarray) -> np.ndarray:
    """A numpy view of a tensor (a host copy if it is not on the CPU; bfloat16, which numpy lacks, as
    float32: every use here computes in float32 or float64); an array as it is."""
    if isinstance(t, np.ndarray):
        return t
    if t.dtype == torch.bfloat16:
        t = t.float()
    if t.is_cpu and not t.requires_grad:  # (the engine's rows: one call instead of three, ~2 us each cold)
        return t.numpy()
    return t.detach().cpu().numpy()


def rank_order(key: Tensor) -> Tensor:
    """(N, V) keys -> (N, V) token ids, best first: key descending, ties by smaller token id.

    Equals ``torch.sort(-key, stable=True).indices``; on CPU it is computed with numpy (see
    :func:`_stable_argsort_rows`) when the vocabulary is large (for tiny ones the per-call overhead
    dominates and torch's sort is used).
    """
    neg_key = -key
    if neg_key.device.type != "cpu" or not _NUMPY_SORT_MIN_VOCAB < neg_key.shape[-1] < 2**31:
        return torch.sort(neg_key, dim=-1, stable=True).indices
    return torch.from_numpy(_stable_argsort_rows(neg_key.numpy()))


def _stable_argsort_rows(keys: np.ndarray) -> np.ndarray:
    """Row-wise ascending argsort with ties in increasing index order, for a 2-D float array.

    float32 keys: one sort of the int64 values ``(sortable bits of the key) * 2^32 + index``, which are
    distinct, so numpy's fast unstable sort gives exactly the stable order. Other dtypes: numpy's
    default argsort (much faster than a stable sort, ties in arbitrary order), then the tied runs
    (few for real-valued ratios; whole rows when p = q) are put in index order by sorting their
    entries, listed row-major so each run is contiguous, by ``run_id * V + index``, exact in int64.
    """
    vocab = keys.shape[-1]
    if keys.dtype == np.float32:
        bits = (keys + np.float32(0.0)).view(np.int32)  # + 0.0 maps -0.0 to +0.0 (equal keys, equal bits)
        bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order of these = float order
        packed = (bits.astype(np.int64) << 32) | np.arange(vocab, dtype=np.int64)
        packed.sort(axis=-1)
        return packed & 0xFFFFFFFF
    order = np.argsort(keys, axis=-1)
    sorted_keys = np.take_along_axis(keys, order, axis=-1)
    same_as_prev = np.zeros(keys.shape, dtype=bool)
    np.equal(sorted_keys[:, 1:], sorted_keys[:, :-1], out=same_as_prev[:, 1:])
    if not same_as_prev.any():
        return order
    in_run = same_as_prev.copy()
    in_run[:, :-1] |= same_as_prev[:, 1:]
    rows, cols = np.nonzero(in_run)
    run_id = np.cumsum(~same_as_prev[rows, cols])
    order[rows, cols] = np.sort(run_id * vocab + order[rows, cols]) % vocab
    return order


def mass_below_rows(key: Tensor, q64: Tensor) -> Tensor:
    """``W(y)`` for every token: (N, V) keys, (N, V) float64 q -> (N, V) float64.

    Worst-first exclusive cumulative sum of ``q`` in the order of :func:`rank_order`, computed over
    the support of ``q`` only when that is much smaller than V (top-k / top-p rows); tokens outside
    the support get the mass below their rank too, so the rows are exact everywhere.
    """
    support = q64 > 0
    count = int(support.sum(-1).max())
    if count * 4 < key.shape[-1]:
        # Rank only the support: the other tokens' W is the support mass whose key is below theirs.
        return _mass_below_rows_support(key, q64, support)
    return mass_below_rows_sorted(key, q64)


def mass_below_rows_sorted(key: Tensor, q64: Tensor) -> Tensor:
    """:func:`mass_below_rows` by one sort of every whole row, without a host read (the device form
    of GBV, :func:`gbv.verify.gbv.verify_gbv_on_device`): (N, V), (N, V) float64 -> (N, V) float64."""
    order = rank_order(key).flip(-1)
    q_sorted = q64.gather(-1, order)
    below_sorted = torch.cat([torch.zeros_like(q_sorted[:, :1]), q_sorted.cumsum(-1)[:, :-1]], dim=-1)
    return torch.zeros_like(q64).scatter_(-1, order, below_sorted)


def _mass_below_rows_support(key: Tensor, q64: Tensor, support: Tensor) -> Tensor:
    out = torch.zeros_like(q64)
    for row in range(key.shape[0]):
        idx = support[row].nonzero().squeeze(-1)
        sub_key = key[row, idx].unsqueeze(0)
        order = idx[torch.sort(-sub_key, dim=-1, stable=True).indices[0].flip(-1)]  # worst first
        q_sorted = q64[row, order]
        out[row, order] = torch.cat([q_sorted.new_zeros(1), q_sorted.cumsum(-1)[:-1]])
    return out


def power_sum(x: Tensor | float, z: Tensor | float, n: int) -> Tensor | float:
    """``S_n(x, z) = sum_{j=0}^{n-1} x^j z^(n-1-j)`` elementwise, for ``x, z`` in [0, 1] (floats or tensors).

    Horner-like recurrence ``S_1 = 1``, ``S_{m+1} = z S_m + x^m``: only sums of non-negative terms, so
    no cancellation, and every term is at most 1 (no overflow for any n). ``S_n(x, z) (x - z) =
    x^n - z^n``: the stable form of a difference of n-th powers.
    """
    if isinstance(x, Tensor) or isinstance(z, Tensor):
        total = torch.ones_like(x if isinstance(x, Tensor) else z, dtype=torch.float64)
        x_pow = torch.ones_like(total)
        for _ in range(n - 1):
            x_pow = x_pow * x
            total = total * z + x_pow
        return total
    total, x_pow = 1.0, 1.0
    for _ in range(n - 1):
        x_pow *= x
        total = total * z + x_pow
    return total


class RankLaw(Protocol):
    """A law at one node that is a function of each token's rank: ``law(y) = q(y) R(W(y), q(y))``, with
    ``R`` non-decreasing in ``W``. GBV's ``q_G`` and gbv-adaptive's ``q_A`` are of this form.

    The methods take tensors, or numpy arrays for the law returned by :meth:`on_host` (the bucketed
    residual code below runs on numpy: the host forms run on the CPU, where numpy's fixed cost per
    call is a fifth of torch's on these small arrays)."""

    def token_law(self, row: int, below: Tensor, q: Tensor) -> Tensor:
        """``law(y)`` for tokens of node ``row`` with mass-below ``below`` and mass ``q`` (same shapes)."""
        ...

    def block_law(self, row: Tensor, below: Tensor, mass: Tensor) -> Tensor:
        """Total law of contiguous runs of the order: ``below`` = q-mass below the run, ``mass`` = its q-mass."""
        ...

    def ratio_bounds(self, row: Tensor, low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
        """Bounds of ``R`` for tokens whose ``W`` and ``W + q`` lie in ``[low, high]``."""
        ...

    def on_host(self) -> "RankLaw":
        """The same law over numpy arrays (``self`` if it already is)."""
        ...

    def compiled_law(self, row: int) -> tuple[int, int, np.ndarray]:
        """The law at node ``row`` as gbv/verify/_verify_kernels.c evaluates it, ``(kind, K, constants)``
        (its ``RankLaw``: the numpy operations in their order, so the same bits). Optional: the bucket
        split runs its numpy code for a law without it. Called on the :meth:`on_host` copy."""
        ...

    def on_tensors(self) -> "RankLaw":
        """The same law over CPU tensors (``self`` if it already is): for tensor code given host rows."""
        ...


def positive_part_mass(key: Tensor, q64: Tensor, p64: Tensor, scale: Tensor, law: RankLaw) -> Tensor:
    """``sum_x (scale p(x) - law(x))+`` per row, without sorting whole rows: (N, V), (N,) -> (N,) float64.

    Tokens go into buckets by the float32 bits of their key (``_BUCKET_SHIFT``): each bucket is a
    contiguous run of the order, so the bucket's total law is known from the bucket masses alone
    (``law.block_law``). Where the bucket's key range and ``law.ratio_bounds`` settle the sign of
    ``scale p - law`` for the whole bucket, it contributes ``scale P_b - law_b`` or 0; only the other
    buckets are sorted (usually a few, around the crossings of ``scale * key`` and ``R``), and their
    tokens get their exact ``W``. Matches the per-token sum up to rounding.
    """
    if key.shape[-1] < BUCKET_MIN_VOCAB:  # small rows: ranked whole
        return _ranked_positive_part(key, q64, p64, scale, law)
    split = _split_buckets(host_array(key), host_array(q64).astype(np.float64, copy=False),
                           host_array(p64).astype(np.float64, copy=False),
                           host_array(scale).reshape(-1).astype(np.float64), law.on_host())
    return torch.from_numpy(split.settled + split.unsettled_exact()).to(q64.device)


def _ranked_positive_part(key: Tensor, q64: Tensor, p64: Tensor, scale: Tensor, law: RankLaw) -> Tensor:
    row_ids = torch.arange(key.shape[0], device=key.device).unsqueeze(-1)
    law_rows = law.token_law(row_ids, mass_below_rows(key, q64), q64)
    return (scale.reshape(-1, 1).to(torch.float64) * p64 - law_rows).clamp_min(0.0).sum(-1)


@dataclass
class _BucketSplit:
    """What :func:`positive_part_mass` knows of each row before it sorts anything: the settled
    buckets' exact part, and the unsettled buckets' part as bounds (:func:`residual_bounds_ranked`).
    numpy arrays throughout (host code)."""

    key: np.ndarray  # (N, V)
    q64: np.ndarray  # (N, V) float64
    p64: np.ndarray  # (N, V) float64
    scale64: np.ndarray  # (N,)
    law: RankLaw  # on the host
    flat: np.ndarray | None  # (N, V) flat bucket ids (None: not computed yet)
    occupied: np.ndarray  # (B,) flat ids of the occupied buckets
    unsettled: np.ndarray  # (B,) bool
    below: np.ndarray  # (B,) q-mass below each occupied bucket
    settled: np.ndarray  # (N,) the settled buckets' sum
    low: np.ndarray  # (N,) settled + lower bounds of the unsettled buckets
    high: np.ndarray  # (N,) settled + upper bounds of the unsettled buckets

    def unsettled_exact(self, only_row: int | None = None) -> np.ndarray:
        """(N,) the unsettled buckets' exact sum per row (of row ``only_row`` alone when given)."""
        rows = self.key.shape[0]
        pick = self.unsettled
        if only_row is not None:
            pick = pick & (self.occupied // _NUM_BUCKETS == only_row)
        if not pick.any():
            return np.zeros(rows)
        flags = np.zeros(rows * _NUM_BUCKETS, dtype=bool)
        flags[self.occupied[pick]] = True
        below_all = np.zeros(rows * _NUM_BUCKETS)
        below_all[self.occupied] = self.below
        if self.flat is None:
            self.flat = _bucket_ids(self.key)
        return _unsettled_buckets(self.key, self.q64, self.p64, self.scale64, self.law, self.flat, flags, below_all)


def _split_buckets(key: np.ndarray, q64: np.ndarray, p64: np.ndarray, scale64: np.ndarray, law: RankLaw
                   ) -> _BucketSplit:
    """The bucket step of :func:`positive_part_mass`: (N, V) keys, float64 q and p, (N,) float64
    scales, a host law. An unsettled bucket's exact part lies in ``[max(0, s P_b - law_b), s P_b]``:
    a sum of positive parts is at least the positive part of the sum, and at most the sum of the
    ``s p`` terms."""
    rows = key.shape[0]
    if rows == 1 and common.compiled_kernels is not None and key.dtype == np.float32:
        # One row (BV's stop coins ask for one node at a time): the occupied buckets' masses in one
        # compiled call, the same bits as the bincounts below; the tokens' bucket ids only if needed.
        mass, target, below, occupied = occupied_bucket_masses(key[0], q64[0], p64[0], with_ids=True)
        flat = None
    else:
        flat = _bucket_ids(key)
        mass, below = _bucket_masses(flat, q64)
        mass = mass.reshape(-1)
        target = np.bincount(flat.reshape(-1), weights=p64.reshape(-1), minlength=rows * _NUM_BUCKETS)
        # Only occupied buckets count (a few hundred of the ~4,000 per row: keys are ratios near 1), so
        # the rest of the work runs on their flat ids (row * _NUM_BUCKETS + bucket) alone: ~10x fewer.
        occupied = np.flatnonzero(mass + target > 0)  # (both >= 0: one test for either > 0)
        mass, target, below = mass[occupied], target[occupied], below.reshape(-1)[occupied]
    row_ids, bucket = np.divmod(occupied, _NUM_BUCKETS)
    ratio_lo, ratio_hi = law.ratio_bounds(row_ids, below, below + mass)
    key_lo, key_hi = _bucket_key_bounds()
    s = scale64[row_ids]
    # scale * key is compared with R (law = q R), and a bucket with no q-mass has law 0 (only p counts).
    positive = (s * key_lo[bucket] >= ratio_hi) | (mass == 0)
    with np.errstate(invalid="ignore"):  # scale 0 times the top bucket's +inf: NaN, compares False
        zero = (s * key_hi[bucket] <= ratio_lo) & ~positive
    unsettled = ~positive & ~zero
    s_target = s * target
    net = s_target - law.block_law(row_ids, below, mass)
    settled = np.bincount(row_ids, weights=np.where(positive, net, 0.0), minlength=rows)
    low = settled + np.bincount(row_ids, weights=np.where(unsettled, np.maximum(net, 0.0), 0.0), minlength=rows)
    high = settled + np.bincount(row_ids, weights=np.where(unsettled, s_target, 0.0), minlength=rows)
    return _BucketSplit(key, q64, p64, scale64, law, flat, occupied, unsettled, below, settled, low, high)


_BOUNDS: dict = {}


def _bucket_key_bounds() -> tuple[np.ndarray, np.ndarray]:
    """(buckets,) float64 lower and upper key bounds of every bucket, widened by ``_KEY_MARGIN``
    (cached per bucket layout)."""
    cached = _BOUNDS.get(_BUCKET_SHIFT)
    if cached is None:
        edges = np.minimum(np.arange(_NUM_BUCKETS + 1, dtype=np.int64) << _BUCKET_SHIFT, 0x7F800000)
        edge_keys = edges.astype(np.int32).view(np.float32).astype(np.float64)
        # The top bucket (+inf in float32) also holds float64 keys too large for float32: bound it by the
        # largest float32 (never inf, so that scale = 0 gives no 0 * inf).
        key_lo = np.minimum(edge_keys[:-1], float(np.finfo(np.float32).max)) * (1 - _KEY_MARGIN)
        key_hi = edge_keys[1:] * (1 + _KEY_MARGIN)
        key_hi[-1] = math.inf
        cached = _BOUNDS[_BUCKET_SHIFT] = (key_lo, key_hi)
    return cached


def _bucket_ids(key: np.ndarray) -> np.ndarray:
    """Each token's key bucket: (N, V) keys -> (N, V) int64 flat ids ``row * _NUM_BUCKETS + bucket``
    (one ``bincount`` then serves all rows).

    A bucket is a range of the key's float32 bits (float64 keys by their float32 rounding, which is
    monotone), so it is a contiguous run of the order. Negative bits -- -0.0 and ZERO_ZERO_KEY (-1)
    -- clamp to bucket 0 with +0.0.
    """
    ids = np.right_shift(key.astype(np.float32, copy=False).view(np.int32), _BUCKET_SHIFT)
    np.maximum(ids, 0, out=ids)
    flat = ids.astype(np.int64)
    if key.shape[0] > 1:
        flat += (np.arange(key.shape[0]) * _NUM_BUCKETS)[:, None]
    return flat


def _bucket_masses(flat: np.ndarray, q64: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The q-mass of each key bucket and of the buckets ranked below it (worst first): (N, V) flat
    ids of :func:`_bucket_ids` and float64 q -> two (N, buckets) float64 arrays. ``bincount`` adds in
    index order (the sums of torch's ``scatter_add_``, which this code used before)."""
    rows = q64.shape[0]
    mass = np.bincount(flat.reshape(-1), weights=q64.reshape(-1), minlength=rows * _NUM_BUCKETS)
    mass = mass.reshape(rows, _NUM_BUCKETS)
    below = np.zeros_like(mass)
    np.cumsum(mass[:, :-1], axis=-1, out=below[:, 1:])
    return mass, below


def _unsettled_buckets(key: np.ndarray, q64: np.ndarray, p64: np.ndarray, s: np.ndarray, law: RankLaw,
                       flat: np.ndarray, unsettled: np.ndarray, below: np.ndarray) -> np.ndarray:
    """Exact ``sum (s p - law)+`` over the tokens of the unsettled buckets, per row (``s``: (N,) float64
    scales; ``unsettled``, ``below``: flat over row * _NUM_BUCKETS + bucket): sort them (worst first
    within each bucket: key ascending, ties by larger id first) and give each its exact ``W``."""
    rows, vocab = key.shape
    members = np.flatnonzero(unsettled[flat.reshape(-1)])  # the tokens of the flagged buckets
    row, tok = np.divmod(members, vocab)
    buck = flat.reshape(-1)[members]
    order = np.lexsort((-tok, key.reshape(-1)[members].astype(np.float64), buck))
    row, tok, buck = row[order], tok[order], buck[order]
    q_m = q64[row, tok]
    csum = q_m.cumsum()
    start = np.ones(len(buck), dtype=bool)
    start[1:] = buck[1:] != buck[:-1]
    seg_start = np.maximum.accumulate(np.where(start, np.arange(len(buck)), 0))
    within = csum - q_m - (csum[seg_start] - q_m[seg_start])  # mass of earlier (worse) tokens in the bucket
    w_tok = below[buck] + within
    terms = np.maximum(s[row] * p64[row, tok] - law.token_law(row, w_tok, q_m), 0.0)
    return np.bincount(row, weights=terms, minlength=rows)


@dataclass
class RowsOf:
    """A :class:`RankLaw` restricted to some of its nodes (``row`` j -> node ``idx[j]``)."""

    law: RankLaw
    idx: Tensor | np.ndarray

    def token_law(self, row: Tensor, below: Tensor, q: Tensor) -> Tensor:
        return self.law.token_law(self.idx[row], below, q)

    def block_law(self, row: Tensor, below: Tensor, mass: Tensor) -> Tensor:
        return self.law.block_law(self.idx[row], below, mass)

    def ratio_bounds(self, row: Tensor, low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
        return self.law.ratio_bounds(self.idx[row], low, high)

    def on_host(self) -> "RowsOf":
        if isinstance(self.idx, np.ndarray):
            return self
        return RowsOf(self.law.on_host(), host_array(self.idx))

    def compiled_law(self, row: int) -> tuple[int, int, np.ndarray]:
        return self.law.compiled_law(int(self.idx[row]))

    def on_tensors(self) -> "RowsOf":
        if isinstance(self.idx, Tensor):
            return self
        return RowsOf(self.law.on_tensors(), torch.from_numpy(self.idx))


def residual_masses_ranked(key: Tensor, q: Tensor, p: Tensor, rows: list[int], weights: list[float],
                           law: RankLaw) -> list[float]:
    """BV's residual masses ``r_i = sum_x (w_i p_i(x) - law_i(x))+`` at the nodes ``rows`` of a path:
    (L, V) keys, q and p along the path, the weights ``w_i``; by :func:`positive_part_mass`."""
    return positive_part_mass(*_path_nodes(key, q, p, rows, weights, law)).tolist()


def _path_nodes(key: Tensor, q: Tensor, p: Tensor, rows: list[int], weights: list[float], law: RankLaw
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, RankLaw]:
    """The nodes ``rows`` of a path as :func:`positive_part_mass` takes them: keys, float64 q and p,
    the (N,) float64 weights, and the law restricted to those nodes. A contiguous run of nodes (the
    usual case) is taken as a slice: no gather copies."""
    idx = torch.tensor(rows, device=key.device)
    w = torch.tensor(weights, dtype=torch.float64, device=key.device)
    pick = slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else idx
    return key[pick], q[pick].double(), p[pick].double(), w, RowsOf(law, idx)


class MassBounds:
    """Residual masses of some nodes, known in up to three steps, each computed only when asked
    (:func:`residual_bounds_ranked`; what :func:`gbv.verify.block.block_verify_core` takes):

    - ``low[j] <= high[j]``, cheap bounds of every node at once;
    - ``tighter(j)``, tighter bounds of node ``j`` (the key buckets of that node alone);
    - ``exact(j)``, its exact mass (sorting the buckets the tighter bounds left unsettled).

    A stop coin whose uniform falls outside the probabilities of the current bounds is decided
    without the next step (:meth:`gbv.verify.common.TorchRandom.accept_within`).
    """

    def __init__(self, low: list[float], high: list[float], exact=None, tighter=None) -> None:
        self.low, self.high = low, high
        self._exact, self._tighter = exact, tighter

    @classmethod
    def exactly(cls, values: list[float]) -> "MassBounds":
        """Masses known exactly (bounds equal to them)."""
        return cls(list(values), list(values))

    def tighter(self, j: int) -> tuple[float, float]:
        if self._tighter is None or self.low[j] == self.high[j]:
            return self.low[j], self.high[j]
        return self._tighter(j)

    def exact(self, j: int) -> float:
        low, high = self.tighter(j)
        if self._exact is None or low == high:
            return low
        return self._exact(j)  # (block_verify_core asks at most once per node)


# Relative margin of the cheap upper bound ``w * sum p`` of a residual mass, for the rounding of the sums.
MASS_MARGIN = 1e-9


def residual_bounds_ranked(key: Tensor, q: Tensor, p: Tensor, rows: list[int], weights: list[float],
                           law: RankLaw) -> MassBounds:
    """:func:`residual_masses_ranked` in three steps (:class:`MassBounds`). Cheap bounds of every
    node: ``0 <= r_i <= w_i sum_x p_i(x)`` (a sum of positive parts of ``w_i p_i - law_i`` is at most
    the sum of the ``w_i p_i``), which decides most stop coins alone: ``h_i <= w_i`` there, and the
    weights below 1 are often small. Tighter bounds of one node on demand: its settled buckets
    exactly, the unsettled ones (whose tokens need a sort) as ``[max(0, w P_b - law_b), w P_b]``. Its
    exact mass on demand, sorting that node's unsettled buckets only. Below ``BUCKET_MIN_VOCAB``,
    exact masses at once. The buckets run on numpy views of the rows (the host forms' code: CPU).
    ``key`` may be None: each node's keys are then computed (:func:`ranking_key`) where they are needed."""
    if key is None and q.shape[-1] < BUCKET_MIN_VOCAB:
        key = ranking_key(p[:q.shape[0]], q)
    if q.shape[-1] < BUCKET_MIN_VOCAB:
        if isinstance(key, np.ndarray):  # host rows (CPU): whole rows are ranked by tensor code
            key, q, p, law = torch.from_numpy(key), torch.from_numpy(q), torch.from_numpy(p), law.on_tensors()
        return MassBounds.exactly(_ranked_positive_part(*_path_nodes(key, q, p, rows, weights, law)).tolist())
    q_h, p_h = host_array(q), host_array(p)
    key_h = None if key is None else host_array(key)
    law_h = law.on_host()
    totals = p_h[rows].sum(-1, dtype=np.float64).tolist()
    high = [w * total * (1.0 + MASS_MARGIN) for w, total in zip(weights, totals)]
    splits: dict[int, _BucketSplit] = {}
    kernels = common.compiled_kernels
    if (kernels is not None and hasattr(law_h, "compiled_law") and q_h.dtype == np.float32
            and p_h.dtype == np.float32 and q_h.flags.c_contiguous and p_h.flags.c_contiguous
            and (key_h is None or (key_h.dtype == np.float32 and key_h.flags.c_contiguous))):
        # One compiled call per step of a node (float32 rows, float32 keys), the same bits as the numpy
        # code below: ten-odd numpy calls over the occupied buckets and the law's, ~0.2 ms a node right
        # after a forward.
        key_lo, key_hi = _bucket_key_bounds()
        found: dict[tuple[int, bool], tuple[float, float, float, float]] = {}
        node_keys: dict[int, np.ndarray] = {}  # (the exact step follows the tighter one: one key row)

        def compiled_split(j: int, exact: bool) -> tuple[float, float, float, float]:
            if (j, exact) not in found:
                node = rows[j]
                if node not in node_keys:
                    node_keys[node] = ranking_key(p_h[node], q_h[node]) if key_h is None else key_h[node]
                node_key = node_keys[node]
                kind, k, constants = law_h.compiled_law(node)
                found[(j, exact)] = kernels.split_row(node_key, q_h[node], p_h[node], False, float(weights[j]),
                                                      kind, k, constants, key_lo, key_hi, exact)
            return found[(j, exact)]

        def compiled_tighter(j: int) -> tuple[float, float]:
            _, low, high, _ = compiled_split(j, False)
            return low, high

        def compiled_exact(j: int) -> float:
            settled, _, _, unsettled = compiled_split(j, True)
            return settled + unsettled

        return MassBounds([0.0] * len(rows), high, compiled_exact, compiled_tighter)

    def split(j: int) -> _BucketSplit:
        if j not in splits:
            node = rows[j]
            node_key = (ranking_key(p_h[node:node + 1], q_h[node:node + 1]) if key_h is None
                        else key_h[node:node + 1])
            splits[j] = _split_buckets(node_key, q_h[node:node + 1].astype(np.float64),
                                       p_h[node:node + 1].astype(np.float64), np.array([weights[j]]),
                                       RowsOf(law_h, np.array([node])))
        return splits[j]

    def tighter(j: int) -> tuple[float, float]:
        return float(split(j).low[0]), float(split(j).high[0])

    def exact(j: int) -> float:
        return float(split(j).settled[0] + split(j).unsettled_exact()[0])

    return MassBounds([0.0] * len(rows), high, exact, tighter)


# mass_below_among ranks up to this many tokens with np.lexsort, more with _stable_argsort_rows (where
# the compiled sort is not installed).
_LEXSORT_MAX_TOKENS = 1000

# Relative margin of residual_row's key threshold: the candidates are compared in the key's precision
# (float32 keys with a float64 threshold), so the threshold is lowered by more than their rounding.
_THRESHOLD_MARGIN = 1e-6


def residual_row(key: Tensor, q: Tensor, p: Tensor, w: float, law: RankLaw, row: int) -> Tensor:
    """BV's correction distribution ``norm((w p - law)+)`` at node ``row`` of a rank law: (V,) key, q,
    p -> (V,) float64, ranking only the tokens that can carry residual mass.

    ``law = q R(W, q)`` with ``R >= r_min`` (``R`` at ``W = 0``): a token with ``w key <= r_min`` has
    ``w p <= law``, no residual mass. Those tokens rank below all the others (a smaller key), so only
    the others -- the candidates -- need ranking, and their ``W`` is the non-candidates' mass plus
    their own ranks'. The candidates are the tokens with ``key > r_min / w`` lowered by
    ``_THRESHOLD_MARGIN``: a few more than needed near the threshold, whose positive part is 0, so
    that the comparison can run on the keys as they are (no float64 copy of the row). On numpy views
    of the rows (host code, as :func:`residual_bounds_ranked`).
    """
    key_h, q_h, p_h = host_array(key), host_array(q), host_array(p)
    law_h = law.on_host()
    node = np.array([row])
    kernels = common.compiled_kernels
    device = p.device if isinstance(p, Tensor) else "cpu"  # (host rows: a CPU tensor)
    if (kernels is not None and hasattr(law_h, "compiled_law") and key_h.dtype == np.float32
            and p_h.dtype == np.float32 and q_h.dtype in (np.float32, np.float64) and key_h.flags.c_contiguous
            and p_h.flags.c_contiguous and q_h.flags.c_contiguous):
        # One compiled call (the threshold, candidates, their exact ranks, the law and the terms): the
        # same values to rounding (the others' mass and the total are summed in another order).
        dist = np.empty(key_h.shape[-1])
        total = kernels.residual_dist(key_h, q_h, q_h.dtype == np.float64, p_h, float(w), _THRESHOLD_MARGIN,
                                      *law_h.compiled_law(row), dist)
        if not total > 0.0:  # round-off only, as below
            return torch.from_numpy(p_h.astype(np.float64)).to(device)
        return torch.from_numpy(dist).to(device)
    r_min = float(law_h.ratio_bounds(node, np.zeros(1), np.ones(1))[0][0])
    threshold = r_min / w * (1.0 - _THRESHOLD_MARGIN) if w > 0.0 else math.inf
    with np.errstate(over="ignore"):  # (a threshold past float32's range compares as +inf)
        is_candidate = key_h > threshold
    candidates = np.flatnonzero(is_candidate)
    q_c, p_c = q_h[candidates].astype(np.float64), p_h[candidates].astype(np.float64)
    # The candidates' exact ranks among themselves, and all non-candidates below them.
    below_c = mass_below_among(key_h[candidates], q_c)
    outside = q_h.sum(dtype=np.float64, where=~is_candidate)
    terms = np.maximum(w * p_c - law_h.token_law(node, below_c + outside, q_c), 0.0)
    total = float(terms.sum())
    if total <= 0.0:  # a branch of probability 0 in exact arithmetic: round-off only (as normalize_or)
        return torch.from_numpy(p_h.astype(np.float64)).to(device)
    dist = np.zeros(key_h.shape[-1])
    dist[candidates] = terms / total
    return torch.from_numpy(dist).to(device)


def occupied_bucket_masses(key: np.ndarray, q64: np.ndarray, p64: np.ndarray, with_ids: bool = False
                           ) -> tuple[np.ndarray, ...]:
    """One row's key buckets (:func:`_bucket_ids`) as if each were a token: (V,) keys, float64 q and p
    -> (B,) float64 q-mass, p-mass and q-mass of the buckets ranked below, over the B occupied buckets
    in increasing key order (a bucket is a contiguous run of the order), and with ``with_ids`` their
    (B,) int64 bucket ids. The compiled form (float32 keys) gives the same bits: the same sums in the
    same order."""
    kernels = common.compiled_kernels
    if kernels is not None and key.dtype == np.float32:
        size = min(len(key), _NUM_BUCKETS)
        mass_q, mass_p, below = (np.empty(size) for _ in range(3))
        ids = np.empty(size, dtype=np.int64) if with_ids else None
        occupied = kernels.bucket_masses(np.ascontiguousarray(key), np.ascontiguousarray(q64, np.float64),
                                         np.ascontiguousarray(p64, np.float64), mass_q, mass_p, below,
                                         *(() if ids is None else (ids,)))
        found = mass_q[:occupied], mass_p[:occupied], below[:occupied]
        return found + (ids[:occupied],) if with_ids else found
    ids = _bucket_ids(key[None])[0]
    mass_q = np.bincount(ids, weights=q64, minlength=_NUM_BUCKETS)
    mass_p = np.bincount(ids, weights=p64, minlength=_NUM_BUCKETS)
    occupied = (mass_q + mass_p > 0.0).nonzero()[0]
    mass_q, mass_p = mass_q[occupied], mass_p[occupied]
    # The mass below over the occupied buckets only (not _bucket_masses' running sum over all ~4,000
    # buckets: 30 us more per node, in gbv-adaptive's loop over nodes).
    below = np.empty_like(mass_q)
    below[0] = 0.0
    np.cumsum(mass_q[:-1], out=below[1:])
    return (mass_q, mass_p, below, occupied) if with_ids else (mass_q, mass_p, below)


def mass_below_among(key: np.ndarray, q64: np.ndarray) -> np.ndarray:
    """Exact ``W`` among some tokens of one node, as if they were the whole row: (M,) keys and float64
    q of tokens listed in increasing id order -> (M,) float64, the listed q-mass ranked strictly below
    each (:func:`rank_order`'s order: key descending, ties by the smaller id). Arrays, host code.
    Worst first is key ascending, ties by the larger id: for a few hundred tokens one ``lexsort``
    (3-7 us against 25-28 us at 20-150 tokens), for more the packed sort of
    :func:`_stable_argsort_rows` (44 against 46 us at 1,000, 104 against 297 us at 4,000). Both
    give this one order. The compiled form (float32 keys: a quicksort of the packed integers up to 128
    tokens, a radix sort of them above, 4.0 against 17 us at 150 tokens, about 20 against 115 at 4,096)
    gives the same bits: the same order and the same running sum."""
    kernels = common.compiled_kernels
    if kernels is not None and key.dtype == np.float32:
        below = np.empty(len(key))
        kernels.mass_below_among(np.ascontiguousarray(key), np.ascontiguousarray(q64, np.float64), below)
        return below
    if len(key) <= _LEXSORT_MAX_TOKENS:
        worst_first = np.lexsort((-np.arange(len(key)), key))
    else:
        worst_first = _stable_argsort_rows(-key[None])[0][::-1]
    below = np.empty_like(q64)
    below[worst_first] = np.concatenate([[0.0], np.cumsum(q64[worst_first])[:-1]])
    return below
