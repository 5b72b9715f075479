"""How one fixed row's iteration times spread from prompt to prompt (1 thread, bundled pair): the machine's slow spells.

    python scripts/iteration_spells.py                                   # BV L = 4, bfloat16, T = 1, 20 prompts x 2
    python scripts/iteration_spells.py --method ar --dtype float32

Runs the row over GSM8K and HumanEval prompts (128 new tokens, EOS off, the same seed per prompt), ``--rounds`` times
in a row, and times every iteration of the tree decoder (``step``; for ``ar``, each run of plain steps, per step).
For each generation: the 10th percentile, median, mean, 90th percentile and maximum of its full-length iterations
(the last, shortened blocks of a generation left out). Then, over all of them: the iterations slower than 1.3 times
the median of the generations' 10th percentiles (the machine's normal state), their share and how much slower they
ran. The same code on the same texts, so what moves is the machine: on a shared one, how long its slow spells last
and how deep they are says how far any clock-based estimate (``auto``'s) can trust an arm measured at one moment
against another measured at the next. docs/ENGINE.md, "Where `auto` loses, by reason (fifty-second session)".
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gbv.engine import tree_decoder
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="block", choices=["ar", "block"])
    parser.add_argument("--block-len", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=10, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the prompts, one after another")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    times: list[float] = []

    def timed(function, full):
        def wrapper(self, *a, **k):
            start = time.perf_counter()
            new = function(self, *a, **k)
            if full(self, new, *a):
                times.append((time.perf_counter() - start) / (len(new) if args.method == "ar" else 1))
            return new
        return wrapper

    step, plain = tree_decoder.TreeDecoder.step, tree_decoder.TreeDecoder.plain_steps
    # (a block of the row's length; for ar, a run of plain steps: a fixed ar row's step runs plain_steps)
    tree_decoder.TreeDecoder.step = timed(step, lambda self, new, block=None: args.method == "block" and (
        block is None or block >= args.block_len))
    tree_decoder.TreeDecoder.plain_steps = timed(plain, lambda self, new, limit=None: args.method == "ar")
    settings = dict(method=args.method, block_len=args.block_len, temperature=args.temperature, eos_token_id=[])
    per_generation = []
    try:
        generate(pair, prompt_ids=prompts[0], max_new_tokens=16, **settings)  # (first calls of each shape)
        for _ in range(args.rounds):
            for seed, prompt_ids in enumerate(prompts):
                times.clear()
                generate(pair, prompt_ids=prompt_ids, max_new_tokens=128, seed=seed, **settings)
                per_generation.append((seed, sorted(times)))
    finally:
        tree_decoder.TreeDecoder.step, tree_decoder.TreeDecoder.plain_steps = step, plain
    row = "ar" if args.method == "ar" else f"BV L = {args.block_len}"
    unit = "a step" if args.method == "ar" else "an iteration"
    print(f"{row}, {args.dtype}, T = {args.temperature}: ms {unit}, per generation ({args.rounds} rounds of "
          f"{len(prompts)} prompts, in order)\n")
    print("| round | prompt | iterations | p10 | median | mean | p90 | max |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for index, (seed, values) in enumerate(per_generation):
        n = len(values)
        print(f"| {index // len(prompts) + 1} | {seed} | {n} | {values[n // 10] * 1e3:.3f} | {values[n // 2] * 1e3:.3f} | "
              f"{statistics.fmean(values) * 1e3:.3f} | {values[9 * n // 10] * 1e3:.3f} | {values[-1] * 1e3:.3f} |")
    normal = statistics.median(values[len(values) // 10] for _, values in per_generation)
    every = [value for _, values in per_generation for value in values]
    slow = [value for value in every if value > 1.3 * normal]
    fast = [value for value in every if value <= 1.3 * normal]
    print(f"\nThe normal state (median of the generations' p10): {normal * 1e3:.3f} ms. Slower than 1.3x that: "
          f"{len(slow)} of {len(every)} ({len(slow) / len(every):.0%}), at a median of "
          f"{statistics.median(slow) / statistics.median(fast) if slow else float('nan'):.2f}x the others'; "
          f"generations whose median is that slow: "
          f"{sum(1 for _, values in per_generation if values[len(values) // 2] > 1.3 * normal)} of {len(per_generation)}")


if __name__ == "__main__":
    main()
