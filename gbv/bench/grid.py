"""The benchmark grid: parsing the comma-separated options, validating them, expanding settings.

Everything here is cheap and imports no model code, so a bad argument is reported (one line,
exit 2) before any model loads and before anything is written. (Listing the methods imports the
verifier registry, and with it torch.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from gbv.data import DATASETS
from gbv.engine.config import AR, MAX_BLOCK_LEN, MAX_NUM_PATHS
from gbv.engine.config import all_methods as all_engine_methods
from gbv.errors import GbvError

__all__ = ["DATASETS", "HF_METHODS", "MAX_BLOCK_LEN", "MAX_NUM_PATHS", "NO_DRAFT", "Setting", "all_methods",
           "check_methods_available", "check_out_dir", "engine_methods", "exact_methods", "expand_settings",
           "is_single_path", "parse_ints", "parse_list", "parse_names", "parse_temperatures", "positive_int"]

# The methods and data sets come from their registries (gbv.verify, gbv.data): a verifier added
# there is benchmarked here with no change. Only the transformers peers are bench-only rows.
HF_METHODS: tuple[str, ...] = ("hf-assisted", "hf-ar")
# Methods with no draft at all: run once per temperature (K = 1, L recorded as None).
NO_DRAFT: frozenset[str] = frozenset({AR, "hf-ar"})
# Methods that choose K and L themselves (``auto``): also run once per temperature.
ONE_PER_TEMPERATURE: frozenset[str] = NO_DRAFT | {"auto"}
MAX_TEMPERATURE = 100.0


def engine_methods() -> tuple[str, ...]:
    """``ar`` and every verifier registered in :mod:`gbv.verify` (run through ``gbv.generate``)."""
    return all_engine_methods()


def all_methods() -> tuple[str, ...]:
    """Every method ``gbv bench`` runs: the engine's, then the transformers peers."""
    return engine_methods() + HF_METHODS


def exact_methods() -> tuple[str, ...]:
    """Every registered verifier (``--exact`` enumerates verifiers; ``ar`` has nothing to verify)."""
    from gbv.verify import METHODS

    return tuple(METHODS)


def is_single_path(method: str) -> bool:
    """Drafts one path whatever K is (``token``, ``block``, ``hf-assisted``): run once per L, K = 1."""
    if method == "hf-assisted":
        return True
    from gbv.verify import METHODS, is_multi_path

    return method in METHODS and not is_multi_path(method)


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


# What a run writes into --out (plots by their pattern): a folder holding any of these holds results.
RESULT_FILES: tuple[str, ...] = ("results.jsonl", ".results.jsonl.partial", "summary.csv", "summary.md", "meta.json")


def existing_results(path: Path) -> list[Path]:
    """The output files of an earlier run in ``path`` (results, tables, meta, plots)."""
    if not path.is_dir():
        return []
    found = [path / name for name in RESULT_FILES if (path / name).exists()]
    return found + sorted(path.glob("*.png"))


def check_out_dir(out: str, resume: bool = False, overwrite: bool = False) -> Path:
    """The output folder must be a folder or creatable as one, and must not hold an earlier run's
    results unless ``resume`` (continue it) or ``overwrite`` (replace it); nothing is created here."""
    if not out:
        raise GbvError("--out must name an output folder")
    if resume and overwrite:
        raise GbvError("give --resume or --overwrite, not both")
    path = Path(out)
    if path.exists():
        if not path.is_dir():
            raise GbvError(f"--out {out!r} exists and is not a folder")
        if not os.access(path, os.W_OK):
            raise GbvError(f"--out {out!r} is not writable")
        found = existing_results(path)
        if found and not (resume or overwrite):
            raise GbvError(f"--out {out!r} already holds results ({', '.join(p.name for p in found[:3])}"
                           f"{', ...' if len(found) > 3 else ''}); pass --resume to continue that run or "
                           "--overwrite to replace it, or choose another folder")
        return path
    if resume:
        raise GbvError(f"--resume: --out {out!r} does not exist (nothing to resume)")
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise GbvError(f"--out {out!r} cannot be created: {str(ancestor)!r} is a file")
    if not os.access(ancestor, os.W_OK):
        raise GbvError(f"--out {out!r} cannot be created: {str(ancestor)!r} is not writable")
    return path


def clear_outputs(path: Path, keep: tuple[str, ...] = ()) -> None:
    """Delete an earlier run's outputs (but the names in ``keep``), so no stale table or plot can
    sit beside the new ones."""
    for file in existing_results(path):
        if file.name not in keep:
            file.unlink()


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
    """Single-path methods once per L (K = 1); ``ar`` / ``hf-ar`` / ``auto`` once per T; the rest per (K, L)."""
    settings: list[Setting] = []
    for temp in temperatures:
        for method in methods:
            if method in ONE_PER_TEMPERATURE:
                settings.append(Setting(method, 1, None, temp))
            elif is_single_path(method):
                settings.extend(Setting(method, 1, block_len, temp) for block_len in block_lens)
            else:
                settings.extend(Setting(method, k, block_len, temp) for block_len in block_lens for k in num_paths)
    return settings
