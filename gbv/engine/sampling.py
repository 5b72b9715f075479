"""Logits -> the distribution actually sampled from, exactly like transformers' ``generate`` warpers.

Order and tie rules follow ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper``
(transformers 5.24, ``generation/logits_process.py``; ``min_tokens_to_keep = 1``): divide by the
temperature, keep every token whose logit is >= the k-th largest (ties kept), then drop the tokens of
smallest probability whose cumulative mass is <= 1 - top_p (the largest always kept), softmax.
Temperature 0 is greedy: a one-hot vector at the first argmax of the raw logits, no division.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gbv.engine.host_kernels import draw_rows_host, host_kernels_unavailable, softmax_into
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


def host_samples(config: SamplingConfig, vocab: int) -> bool:
    """Whether the compiled one-call forwards sample under ``config`` (greedy, or no top-k / top-p)."""
    return config.greedy or ((not config.top_k or config.top_k >= vocab) and config.top_p >= 1.0)


def _host_softmax(logits: Tensor, config: SamplingConfig) -> bool:
    """Whether ``process_logits`` is one compiled softmax here (float32 CPU logits, no top-k or top-p,
    not greedy, the kernels built; :func:`gbv.engine.host_kernels.softmax_into`)."""
    return (logits.dtype == torch.float32 and logits.device.type == "cpu" and not config.greedy
            and (not config.top_k or config.top_k >= logits.shape[-1]) and config.top_p >= 1.0
            and not logits.requires_grad and host_kernels_unavailable() is None)


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


# Uniforms drawn per torch.rand call for the engine's host draws (Uniforms).
_UNIFORM_BLOCK = 64


class Uniforms:
    """The float64 uniforms of one CPU generator, drawn ``_UNIFORM_BLOCK`` at a time and handed out in
    order, for the engine's draws on the host (:func:`draw_token`, :func:`sample_into`, the one-call
    forwards of ``lean_host``).

    Why: a ``torch.rand`` of one value cost ~70 us after a bundled-target forward here (torch's
    dispatch runs from a cold cache), 4% of a bfloat16 step. The law is unchanged: the uniforms are
    i.i.d., and each is used once, for one draw. Every host draw of a sequence (alone or as a batch
    row) takes them from its generator's :func:`uniforms_for`, so a seed gives the same tokens either
    way. Where the drawn tokens must not depend on this buffering (``sample``), torch.rand is called."""

    __slots__ = ("generator", "values", "index", "__weakref__")

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator
        self.values: list[float] = []
        self.index = 0

    def one(self) -> float:
        if self.index >= len(self.values):
            self.values = torch.rand(_UNIFORM_BLOCK, generator=self.generator, dtype=torch.float64).tolist()
            self.index = 0
        self.index += 1
        return self.values[self.index - 1]

    def array(self, count: int) -> np.ndarray:
        return np.array([self.one() for _ in range(count)], dtype=np.float64)


_STREAMS: "weakref.WeakKeyDictionary[torch.Generator, Uniforms]" = weakref.WeakKeyDictionary()


def uniforms_for(generator: torch.Generator | None) -> Uniforms:
    """The :class:`Uniforms` of ``generator`` (one per generator; None: the default generator's)."""
    if generator is None:
        generator = torch.default_generator
    stream = _STREAMS.get(generator)
    if stream is None:
        stream = _STREAMS[generator] = Uniforms(generator)
    return stream


def draw_token(logits: Tensor, config: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token from (V,) ``logits`` under ``config``: the law of ``sample(process_logits(logits,
    config)[None], generator, config.greedy)`` (the same probabilities and rule), in one compiled call
    where :func:`process_logits` would be one, with its uniform from :func:`uniforms_for`. Why: a
    plain target step's torch calls around its forward (softmax, uniform, draw, reading the token
    back) cost ~190 us here from a cold cache, 10% of a bfloat16 bundled-target step."""
    if _host_softmax(logits, config) and (generator is None or generator.device.type == "cpu"):
        return softmax_into(logits.reshape(1, -1).numpy(), config.temperature, u=uniforms_for(generator).one())
    probs = process_logits(logits, config)
    return int(sample(probs[None], generator, config.greedy)[0])


def sample_into(logits: Tensor, config: SamplingConfig, generator: torch.Generator | None, probs: Tensor) -> Tensor:
    """``probs[:] = process_logits(logits, config)`` and one draw per row from them, by
    ``sample``'s rule, in one compiled call where :func:`process_logits` would be one (its uniforms
    then from :func:`uniforms_for`). ``logits``, ``probs``: (R, V); returns (R,) long."""
    if _host_softmax(logits, config) and (generator is None or generator.device.type == "cpu"):
        tokens = np.empty(logits.shape[0], dtype=np.int64)
        softmax_into(logits.numpy(), config.temperature, probs.numpy(), uniforms_for(generator).array(logits.shape[0]),
                     tokens)
        return torch.from_numpy(tokens)
    probs.copy_(process_logits(logits, config))
    return sample(probs, generator, config.greedy)


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
