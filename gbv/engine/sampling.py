"""Logits -> the distribution actually sampled from, exactly like transformers' ``generate`` warpers.

Order and tie rules follow ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``
(transformers 5.24, ``generation/logits_process.py``; ``min_tokens_to_keep = 1``): divide by the
temperature, keep every token whose logit is >= the k-th largest (ties kept), then drop the tokens of
smallest probability whose cumulative mass is <= 1 - top_p (the largest always kept), softmax.
Temperature 0 is greedy: a one-hot vector at the first argmax of the raw logits, no division.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gbv.engine.host_kernels import draw_rows_host, draw_rows_host_at, host_kernels_unavailable, softmax_into
from gbv.verify.common import TorchRandom, draw_rows, draw_rows_at


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings of one model. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def host_samples(config: SamplingConfig, vocab: int) -> bool:
    """Whether the compiled one-call forwards sample under ``config`` (greedy, or no top-k / top-p)."""
    return config.greedy or ((not config.top_k or config.top_k >= vocab) and config.top_p >= 1.0)


def _host_softmax(logits: Tensor, config: SamplingConfig) -> bool:
    """Whether ``process_logits`` is one compiled softmax here (float32 CPU logits, no top-k or top-p,
    not greedy, the kernels built; :func:`gbv.engine.host_kernels.softmax_into`)."""
    return (logits.dtype == torch.float32 and logits.device.type == "cpu" and not config.greedy
            and host_samples(config, logits.shape[-1]) and not logits.requires_grad
            and host_kernels_unavailable() is None)


def process_logits(logits: Tensor, config: SamplingConfig) -> Tensor:
    """(..., V) logits -> (..., V) float32 probabilities (the law sampled from).

    Float32 logits on the CPU without top-k or top-p take one compiled call where the kernels are
    built (the same softmax up to float rounding; a plain target step spent ~40 us in torch's calls
    here, from a cold cache); everything else, and ``GBV_HOST_KERNELS=0``, takes torch's."""
    if _host_softmax(logits, config):
        vocab = logits.shape[-1]
        rows = logits.reshape(-1, vocab)
        probs = torch.empty(rows.shape, dtype=torch.float32)
        softmax_into(rows.numpy(), config.temperature, probs.numpy())
        return probs.view(logits.shape)
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


def draw_token(logits: Tensor, config: SamplingConfig, rng: TorchRandom) -> int:
    """One token from (V,) ``logits`` under ``config``: the law of ``sample(process_logits(logits,
    config)[None], rng.generator, config.greedy)`` (the same probabilities and rule), in one compiled
    call where :func:`process_logits` would be one, its uniform then from ``rng.uniform()``. Why: a
    plain target step's torch calls around its forward (softmax, uniform, draw, reading the token
    back) cost ~190 us here from a cold cache, 10% of a bfloat16 bundled-target step."""
    if _host_softmax(logits, config) and rng.generator.device.type == "cpu":
        return softmax_into(logits.reshape(1, -1).numpy(), config.temperature, u=rng.uniform())
    probs = process_logits(logits, config)
    return int(sample_at(probs[None], None if config.greedy else token_uniform(rng), config.greedy)[0])


def draw_tokens(logits: Tensor, config: SamplingConfig, rngs: list[TorchRandom]) -> list[int]:
    """One token per row of (n, V) ``logits`` under ``config``, row ``i``'s from ``rngs[i]``: what
    :func:`draw_token` gives each row alone, the same tokens from the same uniforms (taken in row order),
    in one call where it can be: one compiled softmax and draw over the rows (CPU generators, where
    ``draw_token`` would take one such call a row), one argmax (greedy: one read-back, not one a row).
    Elsewhere a ``draw_token`` call a row. Why: the plain rows of a batch step each took a call: at 16
    greedy rows of ``ar`` in bfloat16 a third of the step's host work (0.98-1.18 -> 0.65 ms a step;
    scripts/batch_step_split.py); sampled rows' calls were cheap already (unchanged within noise)."""
    if config.greedy:  # (draw_token's one-hot at the first argmax, drawn greedily: that argmax)
        return logits.float().argmax(-1).tolist()
    if _host_softmax(logits, config) and all(rng.generator.device.type == "cpu" for rng in rngs):
        u = np.array([rng.uniform() for rng in rngs], dtype=np.float64)
        tokens = np.empty(len(rngs), dtype=np.int64)
        softmax_into(logits.numpy(), config.temperature, None, u, tokens)
        return tokens.tolist()
    return [draw_token(row, config, rng) for row, rng in zip(logits, rngs)]


def fill_token_uniform(out: Tensor, rng: TorchRandom) -> Tensor:
    """:func:`token_uniform` written into ``out`` ((1, 1) float64 on the generator's device): the same
    value, from the same place in the same stream (a device's ``uniform_`` is ``torch.rand``'s)."""
    generator = rng.generator
    if generator.device.type == "cpu":
        return out.fill_(rng.uniform())
    return out.uniform_(generator=generator)


def token_uniform(rng: TorchRandom) -> Tensor:
    """The uniform of one token's draw: (1, 1) float64 on the device of ``rng``'s generator; a CPU
    generator's from ``rng.uniform()`` (its buffered block), a device's from one ``uniform_`` there
    (``torch.rand``'s draw)."""
    return fill_token_uniform(torch.empty((1, 1), dtype=torch.float64, device=rng.generator.device), rng)


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


def sample_at(probs: Tensor, u: Tensor | None, greedy: bool = False) -> Tensor:
    """:func:`sample` with its uniforms given: ``u`` (N, 1) float64 (None when greedy), on the device
    of ``probs`` (N, V); it may be overwritten. Returns (N,) long."""
    if greedy:
        return probs.argmax(-1)
    drawn = draw_rows_host_at(probs, u)
    return drawn if drawn is not None else draw_rows_at(probs, u)


def sample_into_at(logits: Tensor, config: SamplingConfig, probs: Tensor, u: Tensor | None) -> Tensor:
    """``probs[:] = process_logits(logits, config)`` ((R, V)) and one draw per row from them by
    :func:`sample`'s rule, with its uniforms given (as :func:`sample_at`), in one compiled call where
    :func:`process_logits` would be one. Returns (R,) long."""
    if u is not None and _host_softmax(logits, config) and u.device.type == "cpu":
        tokens = np.empty(logits.shape[0], dtype=np.int64)
        softmax_into(logits.numpy(), config.temperature, probs.numpy(), u.reshape(-1).numpy(), tokens)
        return torch.from_numpy(tokens)
    probs.copy_(process_logits(logits, config))
    return sample_at(probs, u, config.greedy)
