"""Logits -> the distribution actually sampled from, exactly like transformers' ``generate`` warpers.

Order and tie rules follow ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``
(transformers 5.24, ``generation/logits_process.py``; ``min_tokens_to_keep = 1``): divide by the
temperature, keep every token whose logit is >= the k-th largest (ties kept), then drop the tokens of
smallest probability whose cumulative mass is <= 1 - top_p (the largest always kept), softmax.
Temperature 0 is greedy: a one-hot vector at the first argmax of the raw logits, no division.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gbv.engine.host_kernels import draw_rows_host
from gbv.verify.common import draw_rows


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings of one model. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: Tensor, config: SamplingConfig) -> Tensor:
    """(..., V) logits -> (..., V) float32 probabilities (the law sampled from)."""
    logits = logits.float()
    if config.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if config.temperature != 1.0:
        logits = logits / config.temperature
    vocab = logits.shape[-1]
    if config.top_k and config.top_k < vocab:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - config.top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(dim=-1)


def sample(probs: Tensor, generator: torch.Generator | None, greedy: bool = False) -> Tensor:
    """One draw per row of (N, V) ``probs`` -> (N,) long. Greedy rows take the argmax (no randomness).

    Inverse CDF (:func:`gbv.verify.common.draw_rows`): one uniform per row; unlike
    ``torch.multinomial`` it never reads anything back to the host. On the CPU in float32 the compiled
    kernel draws by the same rule from the same uniforms (:func:`draw_rows_host`, 5-7x cheaper).
    """
    if greedy:
        return probs.argmax(-1)
    drawn = draw_rows_host(probs, generator)
    return drawn if drawn is not None else draw_rows(probs, generator)
