"""Where the bundled target/draft pair lives (``gbv/models/bundled/{target,draft}``).

The pair is a pair of small Llama models (HF format, with tokenizer files in both directories)
trained by ``scripts/train_bundled_pair.py``; see ``gbv/models/bundled/README.md``.
This module only locates the files; ``gbv.load_pair("bundled")`` loads them.
"""

from __future__ import annotations

from pathlib import Path

from gbv.errors import GbvError

BUNDLED_DIR: Path = Path(__file__).resolve().parent / "bundled"

REQUIRED_FILES: tuple[str, ...] = ("config.json", "model.safetensors", "tokenizer.json",
                                   "tokenizer_config.json")


def bundled_paths() -> tuple[Path, Path]:
    """Return ``(target_dir, draft_dir)`` of the bundled pair.

    Raises ``GbvError`` (a ``ValueError``) naming the missing files if the package was installed
    without them (e.g. a build that dropped package data).
    """
    dirs = (BUNDLED_DIR / "target", BUNDLED_DIR / "draft")
    missing = [str(d / f) for d in dirs for f in REQUIRED_FILES if not (d / f).is_file()]
    if missing:
        raise GbvError(
            f"bundled model files are missing ({', '.join(missing)}); reinstall gbv with its "
            "package data (pip install .) or pass target=/draft= model paths instead")
    return dirs


__all__ = ["BUNDLED_DIR", "REQUIRED_FILES", "bundled_paths"]
