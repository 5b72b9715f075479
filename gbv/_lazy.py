"""Names a package takes from its modules only when first asked for (PEP 562), so that importing the package does
not import what those modules import (torch, transformers, scipy). ``gbv``, ``gbv.verify`` and ``gbv.theory``."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_names(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package called ``package``: ``names`` maps each name to the module that
    defines it, imported when the name is first asked for; ``__dir__`` lists the package's own names and these."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
