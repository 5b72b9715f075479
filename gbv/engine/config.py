"""``GenerationConfig``: every setting of one generation, validated in one place.

:func:`gbv.generate`, :func:`gbv.engine.generate.stream_generate`, ``gbv generate`` and ``gbv bench``
build one of these and pass it on, instead of a dozen loose parameters. It imports no torch, so the
CLI can reject a bad value (exit 2) before paying for the heavy imports.

Caps (why these numbers): every iteration holds ``K x L`` draft distributions and ``K x (L+1)``
target distributions over the whole vocabulary, plus K copies of both KV caches. At K = 16, L = 32 and
a 128k vocabulary the probabilities alone take about 0.5 GB in float32, while the gain per extra
path is already small at K = 4 (GBV's block efficiency 3.11 -> 3.15 from K = 3 to 4 at T = 1, L = 8,
docs/RESULTS.md). Larger values only ever exhausted memory (``--num-paths 100000`` was killed by the
OOM killer after 24 GB), so they are refused with the allowed range in the message; within the caps,
:func:`gbv.engine.generate.memory_estimate` refuses a generation that would not fit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gbv.errors import GbvError

AR = "ar"  # plain sampling from the target alone (no draft, no verifier)
AUTO = "auto"  # chooses the method, K and L per iteration (gbv.engine.auto); the default
MAX_NUM_PATHS = 16
MAX_BLOCK_LEN = 32
MAX_NEW_TOKENS = 1_000_000


class ConfigError(GbvError):
    """A bad setting: ``field`` names it (``num_paths``), ``detail`` says what is allowed. The CLI
    rewrites the field as its flag (``--num-paths``)."""

    def __init__(self, field: str, detail: str, message: str | None = None) -> None:
        super().__init__(message or f"{field} {detail}")
        self.field = field
        self.detail = detail


def all_methods() -> tuple[str, ...]:
    """Every method accepted: ``ar``, ``auto``, then the verifiers registered in :mod:`gbv.verify`
    (imports it)."""
    from gbv.verify import METHODS

    return (AR, AUTO, *METHODS)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(name: str, value: Any, low: int, high: int, note: str = "") -> None:
    if not _is_int(value) or not low <= value <= high:
        raise ConfigError(name, f"must be an integer from {low} to {high}{note}, got {value!r}")


def _temperature(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
        raise ConfigError(name, f"must be a number >= 0 (0 = greedy), got {value!r}")


@dataclass(frozen=True)
class GenerationConfig:
    """Settings of one generation (see :func:`gbv.generate` for what each means).

    ``eos_token_id``: None = the tokenizer's / generation config's, ``()`` = none; an int or a
    sequence is stored as a tuple. ``stop_strings``: a string or a sequence, stored as a tuple
    without empty strings. Construction raises :class:`ConfigError` (a GbvError) on a bad value.
    """

    method: str = AUTO
    num_paths: int = 3
    block_len: int = 8
    temperature: float = 1.0
    draft_temperature: float | None = None
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    eos_token_id: int | tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        # Numbers first: they need no imports, so the CLI rejects them at once.
        _int_in("num_paths", self.num_paths, 1, MAX_NUM_PATHS, " (K, drafted paths)")
        _int_in("block_len", self.block_len, 1, MAX_BLOCK_LEN, " (L, drafted tokens per path)")
        _int_in("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        _temperature("temperature", self.temperature)
        if self.draft_temperature is not None:
            _temperature("draft_temperature", self.draft_temperature)
        _int_in("top_k", self.top_k, 0, 2**31 - 1, " (0 = off)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", f"must be in (0, 1] (1 = off), got {self.top_p!r}")
        _int_in("seed", self.seed, -(2**63), 2**63 - 1 - 2**20)  # room for the per-prompt seed + i of a batch
        object.__setattr__(self, "eos_token_id", _eos(self.eos_token_id))
        object.__setattr__(self, "stop_strings", _stops(self.stop_strings))
        if not isinstance(self.method, str) or self.method not in all_methods():
            choices = f"choose one of: {', '.join(all_methods())}"
            raise ConfigError("method", choices, f"unknown method {self.method!r}; {choices}")

    def replace(self, **changes: Any) -> GenerationConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def needs_draft(self) -> bool:
        """A verifier needs a draft model; ``ar`` and ``auto`` run without one (``auto`` then only
        chooses plain decoding)."""
        return self.method not in (AR, AUTO)

    @property
    def uses_draft(self) -> bool:
        """Whether the pair's draft (if any) takes part."""
        return self.method != AR

    @property
    def target_sampling(self):
        """The target's :class:`gbv.engine.sampling.SamplingConfig`."""
        from gbv.engine.sampling import SamplingConfig

        return SamplingConfig(float(self.temperature), int(self.top_k), float(self.top_p))

    @property
    def draft_sampling(self):
        """The draft's: ``draft_temperature`` (default ``temperature``), the same top-k / top-p."""
        from gbv.engine.sampling import SamplingConfig

        temperature = self.temperature if self.draft_temperature is None else self.draft_temperature
        return SamplingConfig(float(temperature), int(self.top_k), float(self.top_p))


def _eos(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if _is_int(value):
        value = (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(_is_int(v) and v >= 0
                                                                                      for v in value):
        raise ConfigError("eos_token_id", f"must be None, a token id or a list of token ids, got {value!r}")
    return tuple(int(v) for v in value)


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(s, str) for s in value):
        raise ConfigError("stop_strings", f"must be a string or a list of strings, got {value!r}")
    return tuple(s for s in value if s)
