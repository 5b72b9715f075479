"""The benchmark grid: parsing the comma-separated options, validating them, expanding settings.

Everything here is cheap and imports no model code, so a bad argument is reported (one line,
exit 2) before any model loads and before anything is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from gbv.errors import GbvError

DATASETS: tuple[str, ...] = ("gsm8k", "humaneval", "math500")
# Methods driven by gbv.generate, plus the transformers peers.
ENGINE_METHODS: tuple[str, ...] = ("ar", "token", "block", "specinfer", "spectr", "traversal", "gbv",
                                   "gbv-adaptive")
HF_METHODS: tuple[str, ...] = ("hf-assisted", "hf-ar")
ALL_METHODS: tuple[str, ...] = ENGINE_METHODS + HF_METHODS
# Methods that draft one path: run once per L (K recorded as 1), not once per K.
SINGLE_PATH: frozenset[str] = frozenset({"token", "block", "hf-assisted"})
# Methods with no draft at all: run once per temperature (K = 1, L recorded as None).
NO_DRAFT: frozenset[str] = frozenset({"ar", "hf-ar"})
EXACT_METHODS: tuple[str, ...] = ("token", "block", "specinfer", "spectr", "traversal", "gbv", "gbv-adaptive")

MAX_NUM_PATHS = 16
MAX_BLOCK_LEN = 64
MAX_TEMPERATURE = 100.0

T = TypeVar("T")


def parse_list(text: str, name: str, convert: Callable[[str], T]) -> list[T]:
    """``"1,2,3"`` -> ``[1, 2, 3]``; duplicates dropped, order kept; one-line error otherwise."""
    if text is None:
        raise GbvError(f"--{name} needs a value")
    items = [item.strip() for item in str(text).split(",")]
    if not items or any(item == "" for item in items):
        raise GbvError(f"--{name} must be a comma-separated list without empty items, got {text!r}")
    out: list[T] = []
    for item in items:
        try:
            value = convert(item)
        except ValueError:
            kind = "an integer" if convert is int else "a number"
            raise GbvError(f"--{name}: {item!r} is not {kind}") from None
        if value not in out:
            out.append(value)
    return out


def parse_ints(text: str, name: str, low: int, high: int) -> list[int]:
    values = parse_list(text, name, int)
    for value in values:
        if not low <= value <= high:
            raise GbvError(f"--{name} must be between {low} and {high}, got {value}")
    return values


def parse_temperatures(text: str) -> list[float]:
    values = parse_list(text, "temperature", float)
    for value in values:
        if not (value == value) or value < 0 or value > MAX_TEMPERATURE:  # NaN check first
            raise GbvError(f"--temperature must be between 0 and {MAX_TEMPERATURE:g}, got {value!r}")
    return values


def parse_names(text: str, name: str, allowed: tuple[str, ...]) -> list[str]:
    values = parse_list(text, name, str)
    for value in values:
        if value not in allowed:
            raise GbvError(f"unknown {name.rstrip('s')} {value!r} in --{name}; choose from: {', '.join(allowed)}")
    return values


def positive_int(value: int | None, name: str, high: int | None = None) -> int:
    if value is None or value < 1:
        raise GbvError(f"--{name} must be a positive integer, got {value}")
    if high is not None and value > high:
        raise GbvError(f"--{name} must be at most {high}, got {value}")
    return value


def check_out_dir(out: str) -> Path:
    """The output folder must be a folder or creatable as one; nothing is created here."""
    if not out:
        raise GbvError("--out must name an output folder")
    path = Path(out)
    if path.exists():
        if not path.is_dir():
            raise GbvError(f"--out {out!r} exists and is not a folder")
        if not os.access(path, os.W_OK):
            raise GbvError(f"--out {out!r} is not writable")
        return path
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise GbvError(f"--out {out!r} cannot be created: {str(ancestor)!r} is a file")
    if not os.access(ancestor, os.W_OK):
        raise GbvError(f"--out {out!r} cannot be created: {str(ancestor)!r} is not writable")
    return path


def check_methods_available(methods: list[str]) -> None:
    """Every verifier named must be importable (a missing one fails here, not mid-sweep)."""
    from gbv.verify import METHODS, get_verifier

    for method in methods:
        if method in NO_DRAFT or method in HF_METHODS:
            continue
        if method not in METHODS:
            raise GbvError(f"method {method!r} has no verifier in gbv.verify (known: {', '.join(METHODS)})")
        try:
            get_verifier(method)
        except (ImportError, AttributeError) as exc:
            raise GbvError(f"method {method!r} is not available in this install: {exc}") from None


@dataclass(frozen=True)
class Setting:
    """One cell of the grid: a method at (K, L, T). ``block_len`` is None for methods without a draft."""

    method: str
    num_paths: int
    block_len: int | None
    temperature: float

    def key(self) -> tuple:
        return (self.method, self.num_paths, self.block_len, self.temperature)


def expand_settings(methods: list[str], num_paths: list[int], block_lens: list[int],
                    temperatures: list[float]) -> list[Setting]:
    """Single-path methods once per L (K = 1); ``ar`` / ``hf-ar`` once per T; the rest per (K, L)."""
    settings: list[Setting] = []
    for temp in temperatures:
        for method in methods:
            if method in NO_DRAFT:
                settings.append(Setting(method, 1, None, temp))
            elif method in SINGLE_PATH:
                settings.extend(Setting(method, 1, block_len, temp) for block_len in block_lens)
            else:
                settings.extend(Setting(method, k, block_len, temp) for block_len in block_lens for k in num_paths)
    return settings
