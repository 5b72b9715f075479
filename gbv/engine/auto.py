"""``method="auto"``: choose the verifier, K and L per iteration from what has been measured so far.

Each arm is one setting (``ar``, or a verifier with K paths of L tokens). After every iteration the
arm that ran is credited with the tokens it committed and the wall time it took (the step's own
clock, read after the drafts were read back, so it covers the device work too). The next arm is the
one with the best estimated tokens per second, plus an optimism bonus that shrinks as an arm is
tried (UCB), so that every arm is tried a few times and then the best one runs almost always.

The estimates live as long as the pair and the sampling settings (one :class:`AutoPolicy` per target,
draft, temperature, top-k and top-p; see :func:`policy_for`), so a process that serves many prompts
learns once. It re-learns when the machine changes speed because old observations decay.

Lossless: an iteration is lossless for any (method, K, L), and each choice depends only on the past
(committed tokens are not even looked at: only counts and clocks), never on the drafts or coins of
the iteration it is made for. tests/engine/test_auto.py checks the law by chi-square.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass

from gbv.engine.config import AUTO
from gbv.engine.decoder import set_method
from gbv.engine.stats import GenerationStats
from gbv.verify import METHODS
# Each observation's weight decays by this factor per later observation of the same arm: the
# estimates follow a machine whose speed changes (another process starts), over ~100 iterations.
_DECAY = 0.99
# Exploration: every arm runs this many times before the estimates are trusted.
_MIN_TRIALS = 2
_BONUS = 0.15


@dataclass(frozen=True)
class Arm:
    """One setting of an iteration. ``method`` is ``ar`` (then ``num_paths == block_len == 0``)."""

    method: str
    num_paths: int
    block_len: int

    @property
    def label(self) -> str:
        return "ar" if self.method == "ar" else f"{self.method} K={self.num_paths} L={self.block_len}"


def default_arms(greedy_draft: bool, has_draft: bool) -> list[Arm]:
    """ar, BV at L = 2..8, and a multi-path verifier at K = 2..4 (when the draft samples)."""
    arms = [Arm("ar", 0, 0)]
    if not has_draft:
        return arms
    arms += [Arm("block", 1, length) for length in (2, 3, 4, 6, 8)]
    if not greedy_draft:
        multi = "gbv-adaptive" if "gbv-adaptive" in METHODS else "traversal"
        arms += [Arm(multi, k, length) for k in (2, 3, 4) for length in (4, 8)]
    return arms


class AutoPolicy:
    """Running tokens / seconds per arm, and the UCB choice among them."""

    def __init__(self, arms: list[Arm]) -> None:
        self.arms = list(arms)
        self.tokens = [0.0] * len(arms)
        self.seconds = [0.0] * len(arms)
        self.trials = [0.0] * len(arms)  # decayed counts
        self.runs = [0] * len(arms)  # plain counts

    def rate(self, index: int) -> float:
        return self.tokens[index] / self.seconds[index] if self.seconds[index] > 0 else 0.0

    def choose(self, max_block: int | None = None) -> int:
        """Index of the next arm. ``max_block`` excludes arms with longer blocks (near the end of a
        generation only a short block fits; ``ar`` always fits)."""
        allowed = [i for i, arm in enumerate(self.arms) if max_block is None or arm.block_len <= max_block]
        for i in allowed:
            if self.runs[i] < _MIN_TRIALS:
                return i
        best_rate = max(self.rate(i) for i in allowed) or 1.0
        total = sum(self.trials[i] for i in allowed)
        return max(allowed, key=lambda i: self.rate(i) + _BONUS * best_rate * math.sqrt(
            math.log(max(total, 2.0)) / max(self.trials[i], 1e-9)))

    def record(self, index: int, tokens: int, seconds: float) -> None:
        self.tokens[index] = self.tokens[index] * _DECAY + tokens
        self.seconds[index] = self.seconds[index] * _DECAY + max(seconds, 1e-9)
        self.trials[index] = self.trials[index] * _DECAY + 1.0
        self.runs[index] += 1

    def best(self) -> Arm:
        return self.arms[max(range(len(self.arms)), key=self.rate)]

    def table(self) -> list[dict]:
        return [{"arm": arm.label, "runs": self.runs[i], "tokens_per_s": self.rate(i)}
                for i, arm in enumerate(self.arms)]


_POLICIES: "weakref.WeakKeyDictionary[object, dict[tuple, AutoPolicy]]" = weakref.WeakKeyDictionary()


def policy_for(target, draft, key: tuple, arms: list[Arm]) -> AutoPolicy:
    """The policy shared by every generation with this target, draft and sampling ``key``."""
    per_target = _POLICIES.setdefault(target, {})
    full_key = (id(draft), key, tuple(arms))
    policy = per_target.get(full_key)
    if policy is None:
        policy = per_target[full_key] = AutoPolicy(arms)
    return policy


class AutoDecoder:
    """Runs each iteration of a base decoder (``Decoder`` or ``TreeDecoder``) with the arm the policy
    picks; everything else (tokens, caches, truncation) is the base decoder's."""

    def __init__(self, base, policy: AutoPolicy) -> None:
        self.base = base
        self.policy = policy
        max_block = max(arm.block_len for arm in policy.arms)
        base.stats = GenerationStats(method=AUTO, num_paths=max(arm.num_paths for arm in policy.arms),
                                     block_len=max_block, depth_accept_counts=[0] * max_block)

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def prefill(self, prompt_ids) -> None:
        self.base.prefill(prompt_ids)

    def step(self, block_len: int | None = None) -> list[int]:
        """One iteration with the chosen arm; ``block_len`` caps the block (near the end)."""
        index = self.policy.choose(block_len)
        arm = self.policy.arms[index]
        start = time.perf_counter()
        if arm.method == "ar":
            new = self.base.step(0)
        else:
            set_method(self.base, arm.method, arm.num_paths, arm.block_len)
            new = self.base.step(arm.block_len)
        # The step ended by reading its tokens back to the host, so the device work is done.
        self.policy.record(index, len(new), time.perf_counter() - start)
        arms = self.base.stats.auto_arms
        arms[arm.label] = arms.get(arm.label, 0) + 1
        return new

    def truncate(self, length: int) -> None:
        self.base.truncate(length)
