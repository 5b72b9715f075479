"""``auto`` in fresh processes, with and without the policy an earlier process saved
(gbv.engine.auto_store), against ``ar``: what a one-off ``gbv generate`` gets (bundled pair, 1 thread).

    python scripts/bench_auto_store.py --dtype bfloat16 --temperature 1.0 --rounds 10

Each round runs one process per variant, in alternating order, each generating one prompt (round r:
prompt r of GSM8K then HumanEval in turn, seed r, 128 tokens, EOS off) as its first and only
generation, timed as ``gbv generate`` times it (the generation, not the start-up):

- ``ar``;
- ``auto, fresh``: ``GBV_AUTO_CACHE=0``, the policy learns from nothing;
- ``auto, stored``: ``GBV_AUTO_CACHE=DIR``, the policy starts from the file the earlier processes of
  this variant left (one process on two other prompts fills it before the first round).

Reported: per variant the median over rounds of tokens/s against the same round's ``ar``, the range,
and the pooled tokens/s. The machine is shared: the ratios within a round are what counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def worker(args) -> None:
    import torch

    import gbv
    from gbv.data import load_prompts

    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", dtype=args.dtype)
    prompts = [p for pair_ in zip(load_prompts("gsm8k", 40), load_prompts("humaneval", 40)) for p in pair_]
    out = gbv.generate(pair, prompt=prompts[args.prompt], method=args.method, temperature=args.temperature,
                       max_new_tokens=128, eos_token_id=[], seed=args.prompt)
    print(json.dumps({"tokens": out.stats.new_tokens, "seconds": out.stats.time_total}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--prompt", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    store = tempfile.mkdtemp(prefix="gbv-auto-store-")
    variants = {"ar": ("ar", "0"), "auto, fresh": ("auto", "0"), "auto, stored": ("auto", store)}

    def run(method: str, setting: str, prompt: int) -> dict:
        command = [sys.executable, __file__, "--worker", "--dtype", args.dtype, "--temperature", str(args.temperature),
                   "--method", method, "--prompt", str(prompt)]
        done = subprocess.run(command, env=dict(os.environ, GBV_AUTO_CACHE=setting), capture_output=True, text=True,
                              check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    for prompt in (78, 79):  # the stored variant's first file, from prompts no round uses
        run("auto", store, prompt)
    results = {name: [] for name in variants}
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(variants)[::-1]
        for name in order:
            results[name].append(run(*variants[name], round_))
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rate = {name: [r["tokens"] / r["seconds"] for r in rs] for name, rs in results.items()}
    print(f"`auto` in fresh processes, one 128-token generation each, {args.dtype}, T = {args.temperature}, "
          f"{args.rounds} rounds\n")
    print("| variant | tokens/s (pooled) | vs the round's ar (median) | range |")
    print("|---|---:|---:|---|")
    for name, rs in results.items():
        ratios = [r / a for r, a in zip(rate[name], rate["ar"])]
        pooled = sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)
        print(f"| {name} | {pooled:.1f} | {statistics.median(ratios):.3f}x | {min(ratios):.3f}-{max(ratios):.3f} |")


if __name__ == "__main__":
    main()
