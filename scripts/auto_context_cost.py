"""How an iteration's cost grows with the context, per arm, against what ``auto``'s policy fits (1 thread, bundled pair).

    python scripts/auto_context_cost.py --dtype bfloat16                  # ar and BV L = 2, T = 1
    python scripts/auto_context_cost.py --dtype float32 --blocks 2,4 --prompts 10

Each prompt (N GSM8K + N HumanEval, 128 new tokens, EOS off) runs as a fixed ``ar`` row (its plain steps one
call each, so that each has a time of its own), as fixed BV rows, and as ``auto``, in alternating order. For the
fixed rows: the least-squares line of an iteration's milliseconds in the context (the committed tokens, prompt
included; the first 10 iterations after the prefill left out, where the target's weights come back to the
caches), and the median by bins of 50 tokens. For ``auto``: each arm's line as its policy has it at the end
(``AutoPolicy.context_line``: the slope and the mean context, about the arm's mean seconds). docs/ENGINE.md,
"Costs that grow with the context".
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import torch

from gbv.engine import auto, tree_decoder
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=10, help="prompts per data set")
    parser.add_argument("--blocks", default="2", help="BV block lengths of the fixed rows")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    rows = [("ar", 1)] + [("block", int(b)) for b in args.blocks.split(",")] + [("auto", 1)]
    step, plain_steps = tree_decoder.TreeDecoder.step, tree_decoder.TreeDecoder.plain_steps
    log: dict[tuple[str, int], list[tuple[int, float]]] = collections.defaultdict(list)
    state = {"row": None, "count": 0}

    def note(context: int, seconds: float) -> None:  # (a fixed row's iteration, past its generation's first 10)
        state["count"] += 1
        if state["row"] is not None and state["row"][0] != "auto" and state["count"] > 10:
            log[state["row"]].append((context, seconds))

    def timed(self, block_len=None):
        start, context = time.perf_counter(), len(self.tokens)
        new = step(self, block_len)
        if not (block_len == 0 or self.method == "ar"):  # (ar's steps are timed in plain_steps)
            note(context, time.perf_counter() - start)
        return new

    def one_at_a_time(self, limit):  # ar's plain steps, one call each (a run's steps have no times of their own)
        start, context = time.perf_counter(), len(self.tokens)
        new = plain_steps(self, 1)
        note(context, time.perf_counter() - start)
        return new

    tree_decoder.TreeDecoder.step = timed
    tree_decoder.TreeDecoder.plain_steps = one_at_a_time
    settings = dict(temperature=args.temperature, eos_token_id=[])
    for method, block_len in rows:  # warm-up
        generate(pair, prompt_ids=prompts[0], method=method, block_len=block_len, max_new_tokens=16, **settings)
    auto._POLICIES.clear()  # (auto's policy learns over the measured prompts only)
    for seed, ids in enumerate(prompts):
        for row in (rows if seed % 2 == 0 else rows[::-1]):
            state.update(row=row, count=0)
            generate(pair, prompt_ids=ids, method=row[0], block_len=row[1], max_new_tokens=128, seed=seed,
                     **settings)
    lengths = sorted(len(ids) for ids in prompts)
    print(f"{args.dtype}, T = {args.temperature}, {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens"
          f" (median {lengths[len(lengths) // 2]}), 128 new tokens\n")
    print("| row | ms at 100 tokens | slope, ms per 100 tokens | growth 100 -> 250 | median ms by context |")
    print("|---|---:|---:|---:|---|")
    for row, points in log.items():
        context = np.array([c for c, _ in points], float)
        ms = np.array([s for _, s in points]) * 1e3
        slope, intercept = np.polyfit(context, ms, 1)
        bins = [f"{lo}: {np.median(ms[(context >= lo) & (context < lo + 50)]):.3f}" for lo in range(0, 400, 50)
                if ((context >= lo) & (context < lo + 50)).sum() >= 20]
        at = intercept + 100 * slope
        print(f"| {row[0]} L={row[1]} | {at:.3f} | {slope * 100:.3f} | {(intercept + 250 * slope) / at:.2f}x | "
              f"{', '.join(bins)} |")
    policy = next(iter(auto._POLICIES[pair.target].values()))
    policy.flush()
    policy.close_stretch()
    print("\n`auto`'s policy at the end (seconds an iteration at 100 tokens from its line):\n")
    print("| arm | runs | mean context | ms at 100 tokens | slope, ms per 100 tokens | tokens/s at 100 / 250 |")
    print("|---|---:|---:|---:|---:|---:|")
    for i, arm in enumerate(policy.arms):
        if policy.runs[i] >= auto._MIN_TRIALS:
            tokens, seconds, slope, center = policy.terms(i)
            print(f"| {arm.label} | {policy.runs[i]} | {center:.0f} | {(seconds + slope * (100 - center)) * 1e3:.3f} | "
                  f"{slope * 1e5:.3f} | {policy.rate(i, 100):.0f} / {policy.rate(i, 250):.0f} |")


if __name__ == "__main__":
    main()
