"""The prompts the scripts in this folder measure on: a helper they import (``from prompt_sets import
benchmark_prompt_ids``), not a script to run. It takes nothing from gbv but ``gbv.data.load_prompts``, so that a script
still runs with an older gbv on PYTHONPATH (the before / after runs of ``scripts/bench_rev_ab.py`` and the like)."""
from __future__ import annotations

from gbv.data import load_prompts


def benchmark_prompts(per_set: int) -> list[str]:
    """GSM8K's first ``per_set`` prompts, then HumanEval's first ``per_set`` (arithmetic word problems, then code): the
    engine's tables and diagnostics pair their rows prompt by prompt, in this order."""
    return load_prompts("gsm8k", per_set) + load_prompts("humaneval", per_set)


def benchmark_prompt_ids(tokenizer, per_set: int) -> list[list[int]]:
    """:func:`benchmark_prompts` as token ids: ``tokenizer(text)["input_ids"]`` of each (a Hugging Face tokenizer)."""
    return [tokenizer(text)["input_ids"] for text in benchmark_prompts(per_set)]
