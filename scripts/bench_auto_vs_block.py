"""``auto`` against every fixed block length of BV (its main family) and ``ar``, in one run.

    python scripts/bench_auto_vs_block.py --prompts 10 --temperature 0.2   # ~3 min, 1 thread

Rows: ``ar``, ``block`` at L = 2, 3, 4, 6, 8, and ``auto`` (one policy, learning over the prompts of
the run, its exploration included). Each prompt runs every row, in alternating order, with the same
seed; 128 new tokens, EOS off. Prints pooled tokens/s per row, its ratio to ``ar`` and to the best
fixed row. Why this script: ``scripts/bench_engine.py`` has only L = 4 and 8 among the BV rows, so it
cannot say whether ``auto``'s choice of another length (it often runs L = 2 or 6) costs or pays.
``--log-policy`` also prints, for ``auto``'s timed iterations, how often it ran each arm and what
each arm measured (tokens per iteration, ms per iteration, tokens/s).

``--passes 2`` runs the prompts again with what ``auto`` learned in the first pass (one table a pass: its
learning against its learned policy); ``--family`` runs the bundled shapes in another family's layout
(``engine_toy.family_models``, as scripts/bench_architectures.py):

    python scripts/bench_auto_vs_block.py --family olmo2 --temperature 1.0 --passes 2
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

from gbv.engine import auto
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids

ROWS = [("ar", 0), ("block", 2), ("block", 3), ("block", 4), ("block", 6), ("block", 8), ("auto", 0)]


def label(row: tuple[str, int]) -> str:
    return f"block L={row[1]}" if row[0] == "block" else row[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="the bundled pair's dtype (float32 or bfloat16)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (CUDA graphs, the engine's default there)")
    parser.add_argument("--log-policy", action="store_true", help="per-arm iterations of auto's timed run")
    parser.add_argument("--passes", type=int, default=1, help="runs over the prompts, one table each (default 1)")
    parser.add_argument("--family", default="llama", help="the bundled pair (llama) or its pair in another family's "
                                                          "layout (gptneox, gpt2, olmo2, ...: engine_toy.family_models)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype, device=args.device)
    if args.family != "llama":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
        from engine_toy import family_models
        from gbv.models.loading import ModelPair

        target, draft = family_models(pair.target, pair.draft, args.family)
        pair = ModelPair(target.to(pair.target.dtype), draft.to(pair.draft.dtype), tokenizer=pair.tokenizer)
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    settings = dict(temperature=args.temperature, eos_token_id=[])
    for method, block_len in ROWS:  # warm-up (and auto's policy sees 16 tokens before the timed run)
        generate(pair, prompt_ids=prompts[0], method=method, block_len=max(block_len, 1), max_new_tokens=16, **settings)
    log: list[tuple[str, int, float]] = []
    if args.log_policy:
        record = auto.AutoPolicy._record  # (the one every record goes through, deferred or not)

        def logged(self, index, tokens, seconds, *rest):
            log.append((self.arms[index].label, tokens, seconds))
            return record(self, index, tokens, seconds, *rest)

        auto.AutoPolicy._record = logged
    for pass_ in range(args.passes):
        tokens = {row: 0 for row in ROWS}
        seconds = {row: 0.0 for row in ROWS}
        for seed, prompt_ids in enumerate(prompts):
            for method, block_len in (ROWS if seed % 2 == 0 else ROWS[::-1]):
                sync()
                start = time.perf_counter()
                out = generate(pair, prompt_ids=prompt_ids, method=method, block_len=max(block_len, 1),
                               max_new_tokens=args.max_new_tokens, seed=seed, **settings)
                sync()
                seconds[(method, block_len)] += time.perf_counter() - start
                tokens[(method, block_len)] += out.stats.new_tokens
        rate = {row: tokens[row] / seconds[row] for row in ROWS}
        best = max((r for r in ROWS if r[0] == "block"), key=rate.get)
        which = f", pass {pass_ + 1} of {args.passes}" if args.passes > 1 else ""
        print(f"{args.family} pair, {args.dtype} on {args.device}, T = {args.temperature}, {len(prompts)} prompts, "
              f"{args.max_new_tokens} new tokens, 1 thread{which}")
        print("| row | tokens/s | vs ar | vs best fixed |\n|---|---:|---:|---:|")
        for row in ROWS:
            mark = " (best fixed)" if row == best else ""
            print(f"| {label(row)}{mark} | {rate[row]:.1f} | {rate[row] / rate[ROWS[0]]:.3f}x | {rate[row] / rate[best]:.3f}x |")
        print()
    if args.log_policy:
        auto.AutoPolicy._record = record
    if args.log_policy:
        arms: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0.0])
        for arm, made, spent in log:
            arms[arm][0] += 1
            arms[arm][1] += made
            arms[arm][2] += spent
        print("\n| auto's arm | iterations | tokens / iteration | ms / iteration | tokens/s |\n|---|---:|---:|---:|---:|")
        for arm, (count, made, spent) in sorted(arms.items(), key=lambda kv: -kv[1][0]):
            print(f"| {arm} | {count} | {made / count:.2f} | {spent / count * 1e3:.2f} | {made / spent:.0f} |")


if __name__ == "__main__":
    main()
