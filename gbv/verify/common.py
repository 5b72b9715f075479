"""What every verifier shares: the result type, the random-source protocol, and small helpers.

Shapes (one iteration, one sequence):
    draft_tokens  (K, L)      long   -- K drafted paths of L tokens
    q             (K, L, V)   float  -- q[k, i] = draft distribution the token draft_tokens[k, i] was sampled from
    p             (K, L+1, V) float  -- p[k, i] = target distribution after the first i tokens of path k

``p`` and ``q`` are the distributions actually sampled from (after temperature / top-k / top-p).
All randomness goes through a :class:`RandomSource`, so the same verifier code runs in the engine
(seeded ``torch.Generator``) and in the exact enumerator of :mod:`gbv.theory.enumerate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch
from torch import Tensor

try:  # the host forms' compiled helpers (gbv/verify/_verify_kernels.c, setup.py): gbv-adaptive's
    # weight search, ranking's bucket masses, ranks and masked sums, TorchRandom.sample's draw. The one
    # switch for all of them, looked up at call time (the tests and the A/B scripts set it to None).
    from gbv.verify import _verify_kernels as compiled_kernels
except ImportError:  # pragma: no cover - an install without a C compiler: the numpy code runs
    compiled_kernels = None


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one verification: emit ``draft_tokens[path, :accepted_len]`` then ``next_token``."""

    path: int
    accepted_len: int
    next_token: int


class RandomSource(Protocol):
    """The only two random primitives a verifier may use."""

    def accept(self, prob: float) -> bool:
        """Return True with probability ``prob`` (clipped to [0, 1])."""
        ...

    def sample(self, dist: Tensor) -> int:
        """Draw one index from the normalised probability vector ``dist`` (shape (V,))."""
        ...

    def coins(self, probs: Tensor) -> Tensor:
        """Independent coins: a bool tensor shaped like ``probs``, True with probability ``probs``
        (elementwise, clipped to [0, 1]); on the device, without reading anything back to the host."""
        ...

    def accept_within(self, low: float, high: float, exact: Callable[[], "float | Refinement"]) -> bool:
        """Like ``accept(exact())`` for a probability known to lie in ``[low, high]``; ``exact`` is
        called only where the bounds cannot decide the coin (it may be costly). It may return a
        :class:`Refinement` instead of the value: tighter bounds and the next step, which the coin
        follows in the same way."""
        ...

    def draw(self, dist: Tensor) -> Tensor:
        """Like :meth:`sample`, but returns a 0-d long tensor on the device (no host read)."""
        ...


@dataclass(frozen=True)
class Refinement:
    """What an ``accept_within`` callback may return instead of the exact probability: tighter bounds
    ``[low, high]`` (inside the previous ones) and the next, costlier step towards the exact value.
    BV's stop coins take three steps: bounds from the weight alone, from the key buckets of one
    node, and the exact residual mass (:func:`gbv.verify.block.block_verify_core`)."""

    low: float
    high: float
    exact: Callable[[], "float | Refinement"]


def resolve_refinements(low: float, high: float, exact: Callable[[], float | Refinement]
                        ) -> tuple[float, list[tuple[float, float]]]:
    """Follow an ``accept_within`` callback to the exact probability: ``(value, [(low, high), ...])``,
    the bounds of every step on the way (for random sources that need the value itself)."""
    bounds = [(low, high)]
    value = exact()
    while isinstance(value, Refinement):
        bounds.append((value.low, value.high))
        value = value.exact()
    return float(value), bounds


# Uniforms for TorchRandom.accept are drawn this many at a time and read back in one transfer.
ACCEPT_BLOCK = 64


class TorchRandom:
    """Production random source backed by a seeded ``torch.Generator``.

    :meth:`accept` compares ``prob`` with float64 uniforms drawn ``ACCEPT_BLOCK`` at a time and read
    back to the host in one transfer: one host read per 64 host-side decisions instead of one per
    decision (each is a pipeline stall on a GPU, and a draw plus a read, ~6 us, on CPU). The uniforms
    are i.i.d. and drawn before the decisions that use them, from the generator alone, so the law of
    every decision is the same as with one draw each.
    """

    def __init__(self, generator: torch.Generator | None = None, seed: int | None = None) -> None:
        if generator is None:
            generator = torch.Generator()
            if seed is not None:
                generator.manual_seed(seed)
        self.generator = generator
        self._uniforms: list[float] = []  # drawn, not used yet (used from the end)

    def accept(self, prob: float) -> bool:
        prob = float(prob)
        if prob >= 1.0:
            return True
        if prob <= 0.0:
            return False
        return self.uniform() < prob

    def accept_within(self, low: float, high: float, exact: Callable[[], float | Refinement]) -> bool:
        # One uniform, as accept: True below low, False from high up, and only in between compared with
        # the exact probability. P(True) = low + (exact - low) = exact for low <= exact <= high. A
        # refinement narrows [low, high] around the same exact value and the same uniform is compared
        # again, so each step decides the coin as the exact value would.
        if low >= 1.0:
            return True
        if high <= 0.0:
            return False
        u = self.uniform()
        while True:
            if u < low:
                return True
            if u >= high:
                return False
            value = exact()
            if not isinstance(value, Refinement):
                return u < float(value)
            low, high, exact = value.low, value.high, value.exact

    def uniform(self) -> float:
        """The next U[0, 1) of :meth:`accept`, from the current block (a new block when it is used up).
        The engine's draws on the host (``gbv.engine.sampling.draw_token``, the one-call forwards) take
        theirs here too. Why: a ``torch.rand`` of one value cost ~70 us after a forward that streams
        tens of MB (torch's dispatch runs from a cold cache). Each uniform is used once, so every law
        is unchanged."""
        if not self._uniforms:
            self._uniforms = torch.rand(ACCEPT_BLOCK, generator=self.generator, dtype=torch.float64,
                                        device=self.generator.device).tolist()
        return self._uniforms.pop()

    def uniforms(self, count: int) -> np.ndarray:
        """The next ``count`` uniforms (:meth:`uniform`), as a float64 array."""
        return np.array([self.uniform() for _ in range(count)], dtype=np.float64)

    def sample(self, dist: Tensor) -> int:
        # (torch.multinomial draws one exponential per token; the inverse CDF one uniform.)
        if dist.device.type == "cpu" and dist.dim() == 1 and self.generator.device.type == "cpu":
            # draw_rows' rule on the host, with a uniform of the blocks above: its six torch calls and a
            # torch.rand cost ~0.1 ms after a forward here (a cold cache), two numpy calls a fraction.
            row = dist.numpy()
            kernels = compiled_kernels
            if kernels is not None and row.dtype in (np.float32, np.float64) and row.flags.c_contiguous:
                # the same sums in the same order, one pass and a partial one (cumsum: 23 us at V = 4096)
                return kernels.draw_row(row, row.dtype == np.float64, self.uniform(), BELOW_ONE)
            cdf = np.cumsum(row, dtype=np.float64)
            point = self.uniform() * (float(cdf[-1]) * BELOW_ONE)
            return min(int(np.searchsorted(cdf, point, side="right")), cdf.shape[0] - 1)
        return int(draw_rows(dist, self.generator))

    def coins(self, probs: Tensor) -> Tensor:
        u = torch.rand(probs.shape, generator=self.generator, device=self.generator.device, dtype=torch.float64)
        return u.to(probs.device) < probs

    def draw(self, dist: Tensor) -> Tensor:
        return draw_rows(dist, self.generator)


# u * total * BELOW_ONE stays below total (see draw_rows); public for the engine's compiled draw.
BELOW_ONE = 1.0 - 2.0 ** -52


def draw_rows(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One draw per row of (..., V) non-negative ``probs`` (normalised or not) -> (...) long, on the
    device of ``probs``, without a host read (``torch.multinomial`` checks its input on the host).

    Inverse CDF: the first token whose cumulative mass (float64) exceeds ``u * total`` with
    ``u ~ U[0, 1)``, so token ``v`` is drawn with probability ``probs_v / total``. A token of mass 0
    is never drawn: its cumulative mass equals its predecessor's, which is found first. One uniform
    per row instead of one exponential per token (an exponential race) is 5-14x faster on CPU at
    V = 4k-32k (scripts/bench_verifiers.py and docs/ENGINE.md).
    """
    device = generator.device if generator is not None else probs.device
    u = torch.rand((*probs.shape[:-1], 1), generator=generator, dtype=torch.float64, device=device)
    return draw_rows_at(probs, u.to(probs.device) if u.device != probs.device else u)


def draw_rows_at(probs: Tensor, u: Tensor) -> Tensor:
    """:func:`draw_rows` with its uniforms given: ``u`` (..., 1) float64 in [0, 1), on the device of
    ``probs`` (overwritten). The rule that the other forms of the draw (the compiled ``draw``,
    ``TorchRandom.sample`` on the host) are tested against."""
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)  # (the same sums as .double().cumsum(), one op)
    total = cdf[..., -1:]
    # The point must stay below total (else it would land past the last token of mass > 0). For any
    # normal float64 total (every float32 row with mass has one), total * (1 - 2^-52) rounds to at
    # least one ulp below total, and u < 1 keeps the product at or below that. (The top 2^-52 of the
    # mass is never drawn: below the float64 rounding of the cumulative sums themselves.)
    point = u.mul_(total * BELOW_ONE)
    return torch.searchsorted(cdf, point, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


Verifier = Callable[[Tensor, Tensor, Tensor, RandomSource], VerifyResult]


def check_shapes(draft_tokens: Tensor, q: Tensor, p: Tensor) -> tuple[int, int, int]:
    """Validate the verifier inputs and return ``(num_paths, block_len, vocab)``."""
    # (each shape read once: right after a forward every torch attribute call runs from a cold cache)
    token_shape, q_shape, p_shape = draft_tokens.shape, q.shape, p.shape
    if len(token_shape) != 2:
        raise ValueError(f"draft_tokens must be (K, L), got shape {tuple(token_shape)}")
    num_paths, block_len = token_shape
    if len(q_shape) != 3 or q_shape[0] != num_paths or q_shape[1] != block_len:
        raise ValueError(f"q must be (K, L, V) = ({num_paths}, {block_len}, V), got {tuple(q_shape)}")
    vocab = q_shape[2]
    if len(p_shape) != 3 or p_shape[0] != num_paths or p_shape[1] != block_len + 1 or p_shape[2] != vocab:
        raise ValueError(f"p must be (K, L+1, V) = ({num_paths}, {block_len + 1}, {vocab}), got {tuple(p_shape)}")
    return num_paths, block_len, vocab


def normalize_or(dist: Tensor, fallback: Tensor) -> Tensor:
    """``dist / dist.sum()``; ``fallback`` when ``dist`` has no mass.

    A residual with zero mass is unreachable in exact arithmetic (its branch has probability 0);
    the fallback only guards against floating-point round-off in production.
    """
    total = dist.sum()
    if total.item() <= 0.0:
        return fallback
    return dist / total


def residual(p: Tensor, q: Tensor, scale: float | Tensor = 1.0) -> Tensor:
    """``norm((scale * p - q)+)`` along the last axis, falling back to ``p``. Shape (V,)."""
    return normalize_or((scale * p - q).clamp_min(0.0), p)


def residual_on_device(p: Tensor, q: Tensor, scale: Tensor | float = 1.0) -> Tensor:
    """:func:`residual` without a host read: ``norm((scale * p - q)+)``, or ``p`` where that has no mass
    (a branch of probability 0 in exact arithmetic; the fallback only absorbs round-off). (V,)."""
    dist = (scale * p - q).clamp_min(0.0)
    total = dist.sum()
    return torch.where(total > 0, dist / torch.where(total > 0, total, 1.0), p)


def host_ints(*values: Tensor | int) -> list[int]:
    """Read several 0-d device tensors back to the host at once: the one host read of a verify call."""
    return [int(v) for v in torch.stack([torch.as_tensor(v).reshape(()) for v in values]).tolist()]


def uses_device_form(p: Tensor) -> bool:
    """Whether a verifier with two forms (GBV, gbv-adaptive, SpecInfer, SpecTr, Traversal) runs its
    device form, tensor code with one host read: on every device but the CPU, where the host form is
    faster. Each verifier module imports this name, so a test can force one form per module."""
    return p.device.type != "cpu"


def take_row(rows: Tensor, index: Tensor) -> Tensor:
    """``rows[index]`` for a 0-dim long tensor ``index``, without a host read: (N, ...) -> (...).

    Indexing with a 0-dim tensor makes torch read it back and slice (pytorch/pytorch#105641), a
    pipeline stall on a GPU; ``index_select`` stays on the device."""
    return rows.index_select(0, index.reshape(1))[0]


def on_path_probs(dist: Tensor, tokens: Tensor) -> Tensor:
    """``dist[..., i, tokens[..., i]]``: probability of each drafted token. (…, L, V), (…, L) -> (…, L)."""
    return dist.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# A level rule of a level-wise multi-path verifier: given the node's target and draft rows (V,) and
# the alive paths' draws at that level (in path-index order), return ``(token, None)`` when a draw
# is accepted, or ``(None, dist)`` with the distribution the correction token is sampled from.
LevelRule = Callable[[Tensor, Tensor, list[int], RandomSource], tuple[int | None, Tensor | None]]


def verify_level_by_level(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource,
                          level_rule: LevelRule) -> VerifyResult:
    """The driver shared by SpecInfer and SpecTr: walk the K paths level by level.

    At depth ``d`` the *alive* paths agree with every token accepted so far, so they share one node
    and their ``p``/``q`` rows at ``d`` are the same (the first alive path's rows are used). The rule
    decides the level; an accepted token keeps alive only the paths carrying it; a rejection ends the
    block with a token from the rule's residual; surviving all ``L`` levels earns the bonus ``p_L``.
    Returns the first (lowest-index) path carrying the accepted prefix.
    """
    num_paths, block_len, _ = check_shapes(draft_tokens, q, p)
    tokens = draft_tokens.tolist()
    alive = list(range(num_paths))
    for depth in range(block_len):
        lead = alive[0]
        accepted, correction = level_rule(p[lead, depth], q[lead, depth], [tokens[k][depth] for k in alive], rng)
        if accepted is None:
            return VerifyResult(lead, depth, rng.sample(correction))
        alive = [k for k in alive if tokens[k][depth] == accepted]
    return VerifyResult(alive[0], block_len, rng.sample(p[alive[0], block_len]))


# A level rule in device form: given the node's target and draft rows (V,), every path's draw at that
# level (K,) long and the alive paths (K,) bool, return ``(accept_probs, residual)``: (K,) float64
# acceptance probabilities of the alive draws, each assuming every earlier alive draw was rejected
# (0 for paths that are not alive), and the (V,) distribution the correction token is drawn from
# when every alive draw is rejected. No host reads.
DeviceLevelRule = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def keep_carriers(alive: Tensor, draws: Tensor, token: Tensor) -> Tensor:
    """The alive paths after ``token`` was accepted at a level: those whose draw there is ``token``. (K,)."""
    return alive & (draws == token)


def verify_level_by_level_on_device(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource,
                                    level_rule: DeviceLevelRule) -> VerifyResult:
    """:func:`verify_level_by_level` as tensor code with one host read (SpecInfer's and SpecTr's form
    on a GPU): the same law, by other means.

    Each level's draws are decided by K independent coins drawn at once (``rng.coins``), the accepted
    draw being the first alive path whose coin came up. That is the sequential rule's law: draw ``j``
    is reached only if every earlier alive draw was rejected, and its coin is independent of theirs,
    so ``P(first accepted = j) = a_j prod_{i < j alive} (1 - a_i)`` either way; the coins of draws
    that are not reached are drawn and ignored. The L levels run in a Python loop of tensor ops: a
    level after the stop is computed on the frozen state with probability-0 coins (certain, so the
    exact enumerator does not branch on them) and changes nothing. Path, accepted length and next
    token are read back together at the end.
    """
    num_paths, block_len, _ = check_shapes(draft_tokens, q, p)
    device = p.device
    alive = torch.ones(num_paths, dtype=torch.bool, device=device)
    active = torch.ones((), dtype=torch.bool, device=device)  # no level has rejected yet
    accepted_len = torch.zeros((), dtype=torch.long, device=device)
    stop_path = torch.zeros((), dtype=torch.long, device=device)
    stop_dist = p[0, block_len]  # replaced at the stop level (or unused after a full block)
    for depth in range(block_len):
        lead = alive.to(torch.uint8).argmax()  # the first alive path: its rows are the node's
        draws = draft_tokens[:, depth]
        probs, correction = level_rule(take_row(p[:, depth], lead), take_row(q[:, depth], lead), draws, alive)
        hits = rng.coins(torch.where(active, probs, 0.0)) & alive
        accepted = hits.any()
        token = take_row(draws, hits.to(torch.uint8).argmax())
        stops = active & ~accepted
        stop_dist = torch.where(stops, correction, stop_dist)
        stop_path = torch.where(stops, lead, stop_path)
        goes_on = active & accepted
        accepted_len = accepted_len + goes_on.long()
        alive = torch.where(goes_on, keep_carriers(alive, draws, token), alive)
        active = goes_on
    lead = alive.to(torch.uint8).argmax()
    path = torch.where(active, lead, stop_path)
    next_token = rng.draw(torch.where(active, take_row(p[:, block_len], lead), stop_dist))
    return VerifyResult(*host_ints(path, accepted_len, next_token))
