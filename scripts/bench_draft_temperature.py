"""A sharper (or flatter) draft: tokens/s, block efficiency and tree nodes per target call against
the draft's temperature, in one process, bundled pair, 1 thread.

    python scripts/bench_draft_temperature.py                                  # GBV K=3 L=8 at T = 0.2
    python scripts/bench_draft_temperature.py --rows gbv:3:8,block:4 --draft-temperatures same,0.15,0.1,0.05

Every verifier is lossless for any draft law q (it is told the q it sampled from), so the draft may
sample at another temperature than the target (``draft_temperature=``). A sharper draft makes the K
i.i.d. paths coincide more (fewer distinct tree nodes for the target to score) but matches the
target less (fewer tokens kept). ``same`` is the default: the target's temperature. Each round runs
every (row, draft temperature) and ``ar`` over the same ``--prompts`` GSM8K + ``--prompts``
HumanEval prompts, EOS off, round r with seeds r * prompts + 0.., so that each round gives new texts
(block efficiency varies with the texts). Reported: pooled tokens/s, its ratio to ``ar``, tokens
per target call, and nodes per tree call against K(L+1).
"""
from __future__ import annotations

import argparse
import time

import torch

import gbv

from bench_rev_ab import parse_row  # scripts/ is on the path when run as a script
from prompt_sets import benchmark_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--draft-temperatures", default="same,0.15,0.1,0.05",
                        help="comma-separated: 'same' (the target's) or a temperature > 0")
    parser.add_argument("--rows", default="gbv:3:8")
    parser.add_argument("--prompts", type=int, default=10, help="GSM8K prompts, and as many HumanEval ones")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    try:
        temperatures = [None if t == "same" else float(t) for t in args.draft_temperatures.split(",")]
    except ValueError:
        parser.error(f"--draft-temperatures takes 'same' or numbers, not {args.draft_temperatures!r}")
    if any(t is not None and t <= 0 for t in temperatures):
        parser.error("a draft temperature must be > 0 (a greedy draft drafts one path)")
    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", dtype=getattr(torch, args.dtype))
    prompts = benchmark_prompts(args.prompts)
    cells = [("ar", None)] + [(row, t) for row in args.rows.split(",") for t in temperatures]
    common = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens, eos_token_id=[])
    totals = {cell: [0, 0.0, 0, 0, 0] for cell in cells}  # tokens, seconds, target calls, nodes, tree calls
    with torch.inference_mode():  # (warm-up: the lean views and kernels)
        for row, t in cells:
            gbv.generate(pair, prompt=prompts[0], draft_temperature=t, max_new_tokens=8, **parse_row(row))
    for round_ in range(args.rounds):
        order = cells[round_ % len(cells):] + cells[:round_ % len(cells)]
        for row, t in order:
            for index, prompt in enumerate(prompts):
                seed = round_ * len(prompts) + index  # (each round new texts: block efficiency varies with them)
                began = time.perf_counter()
                out = gbv.generate(pair, prompt=prompt, seed=seed, draft_temperature=t, **parse_row(row), **common)
                seconds = time.perf_counter() - began
                stats = out.stats.to_dict()
                total = totals[row, t]
                total[0] += stats["new_tokens"]
                total[1] += seconds
                total[2] += stats["target_calls"]
                total[3] += stats.get("tree_nodes") or 0
                total[4] += stats.get("tree_calls") or 0
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print(f"\nbundled pair, {args.dtype}, T = {args.temperature}, {len(prompts)} prompts x {args.max_new_tokens} "
          f"tokens, {args.rounds} rounds, 1 thread")
    print("| row | draft temperature | tokens/s | vs ar | tokens / target call | tree nodes / call | of K(L+1) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ar = totals["ar", None][0] / totals["ar", None][1]
    for row, t in cells:
        tokens, seconds, calls, nodes, tree_calls = totals[row, t]
        settings = parse_row(row)
        full = settings.get("num_paths", 1) * (settings.get("block_len", 0) + 1)
        per_call = nodes / tree_calls if tree_calls else 0.0
        share = f"{per_call / full:.2f}" if tree_calls else "-"
        shown = "same" if t is None else f"{t:g}"
        print(f"| {row} | {shown} | {tokens / seconds:.0f} | {tokens / seconds / ar:.2f}x | {tokens / calls:.2f} | "
              f"{per_call:.1f} | {share} |")


if __name__ == "__main__":
    main()
