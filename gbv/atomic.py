"""Atomic file writes: write a temporary file in the same folder, then rename it over the target.

A reader (or a crash) never sees a half-written file: the target holds either the old or the new
content. One helper for every output of gbv (bench tables and plots, ``gbv bound --save``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yields a fresh temporary path beside ``path`` (same suffix, so writers that infer the format
    from it work); on success it is renamed to ``path``, on an exception it is removed."""
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, flushed to disk before the rename."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
