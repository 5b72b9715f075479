"""The policy work ``method="auto"`` adds to each iteration, with the decoder's records deferred to the
next choice (``AutoPolicy.defer``, the default) and applied at once (``before``), in one run.

    python scripts/auto_overhead.py --dtype bfloat16 --temperature 0.2   # ~2 min, 1 thread

Each prompt (8 GSM8K + 8 HumanEval, 128 new tokens, EOS off, twice) runs ``auto`` once per variant, in
alternating order, with one shared policy (both variants make the same choices from the same state).
Prints, per variant, the iterations and the microseconds per iteration between ``AutoDecoder.step``
and the base decoder's ``step`` inside it (choice, record, bookkeeping).
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from gbv.engine import auto, tree_decoder
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per data set")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    spent = collections.Counter()
    variant = ["after"]

    def timed(cls, name: str) -> None:
        inner = getattr(cls, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            result = inner(*a, **k)
            spent[(variant[0], name if cls is auto.AutoDecoder else "base")] += time.perf_counter() - start
            spent[(variant[0], "iterations")] += cls is auto.AutoDecoder
            return result

        setattr(cls, name, wrapper)

    timed(tree_decoder.TreeDecoder, "step")
    timed(auto.AutoDecoder, "step")
    deferred, immediate = auto.AutoPolicy.defer, auto.AutoPolicy.record
    settings = dict(method="auto", max_new_tokens=128, temperature=args.temperature, eos_token_id=[])
    generate(pair, prompt_ids=prompts[0], **{**settings, "max_new_tokens": 64})  # warm-up, first exploration
    spent.clear()
    for repeat in range(2):
        for seed, ids in enumerate(prompts):
            for name in (("before", "after") if (seed + repeat) % 2 else ("after", "before")):
                variant[0] = name
                auto.AutoPolicy.defer = deferred if name == "after" else immediate
                generate(pair, prompt_ids=ids, seed=seed, **settings)
    auto.AutoPolicy.defer = deferred
    print(f"{args.dtype}, T = {args.temperature}, {len(prompts)} prompts x 2, 1 thread")
    print("| records | iterations | base step (us) | policy work per iteration (us) |\n|---|---:|---:|---:|")
    for name, label in (("before", "applied at once"), ("after", "deferred to the next choice")):
        n = spent[(name, "iterations")]
        print(f"| {label} | {n} | {spent[(name, 'base')] / n * 1e6:.0f} | "
              f"{(spent[(name, 'step')] - spent[(name, 'base')]) / n * 1e6:.1f} |")


if __name__ == "__main__":
    main()
