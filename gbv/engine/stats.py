"""What one generation measured."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    """Counters and timings of one :func:`gbv.generate` call.

    ``num_paths`` / ``block_len`` are the values that ran: single-path methods (``token``,
    ``block``) draft 1 path whatever was asked, and ``ar`` drafts nothing (0 and 0). A greedy draft
    (draft temperature 0) drafts one path even for multi-path methods (K copies would be identical).
    ``target_calls`` counts target forwards after the prefill (for ``ar`` it equals ``new_tokens``).
    ``accepted_lengths[i]`` is the verifier's accepted length ``tau`` at iteration ``i``;
    ``depth_accept_counts[d-1]`` is how many iterations accepted at least ``d`` tokens.
    ``tree_nodes`` is the number of token-tree nodes the target scored over its ``tree_calls``
    speculative calls (tree engine only; a node is one distinct drafted prefix or the pending token:
    K paths of L tokens give at most K*L + 1, fewer where paths share prefixes).
    ``auto_arms`` counts the iterations of each (method, K, L) that ``method="auto"`` chose.
    ``block_efficiency = new_tokens / target_calls``. ``time_prefill`` is the prompt through the models:
    the prefill, and the draft's prompt where ``auto`` feeds it later (its first speculative iteration).
    ``time_total`` is the generation after that (``tokens_per_second`` is over it); the generation end
    to end took ``time_prefill + time_total`` (and the call's set-up). ``time_other`` is what
    ``time_total`` spends outside the draft, target and verifier timers (cache surgery, bookkeeping,
    decoding text).
    Near the end of a generation the block is shortened so that no drafted token falls beyond
    ``max_new_tokens``; the very last token may then come from a plain target step (a target call
    without an accepted length).
    """

    method: str
    num_paths: int
    block_len: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_calls: int = 0
    draft_steps: int = 0
    tree_calls: int = 0
    tree_nodes: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    depth_accept_counts: list[int] = field(default_factory=list)
    stop_reason: str = ""
    auto_arms: dict[str, int] = field(default_factory=dict)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_target: float = 0.0
    time_verify: float = 0.0
    time_total: float = 0.0

    @property
    def block_efficiency(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    @property
    def mean_tree_nodes(self) -> float:
        return self.tree_nodes / self.tree_calls if self.tree_calls else 0.0

    @property
    def time_other(self) -> float:
        return max(0.0, self.time_total - self.time_draft - self.time_target - self.time_verify)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_total if self.time_total > 0 else 0.0

    def record_accept(self, tau: int) -> None:
        self.accepted_lengths.append(tau)
        for depth in range(tau):
            self.depth_accept_counts[depth] += 1

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(block_efficiency=self.block_efficiency, mean_accepted_length=self.mean_accepted_length,
                   mean_tree_nodes=self.mean_tree_nodes,
                   time_other=self.time_other, tokens_per_second=self.tokens_per_second)
        return out

    def summary(self) -> str:
        """One line for humans."""
        return (f"{self.method} K={self.num_paths} L={self.block_len}: {self.new_tokens} tokens, "
                f"{self.target_calls} target calls, block efficiency {self.block_efficiency:.2f}, "
                f"{self.tokens_per_second:.1f} tokens/s ({self.time_total:.2f} s; draft {self.time_draft:.2f}, "
                f"target {self.time_target:.2f}, verify {self.time_verify:.2f}, other {self.time_other:.2f}), "
                f"stop: {self.stop_reason}")
