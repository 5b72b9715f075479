"""Where ``auto`` loses against fixed rows: every iteration of the base decoder timed, in ``auto`` and in
fixed rows, in one run (1 thread, bundled pair).

    python scripts/auto_iterations.py --dtype float32 --temperature 0.2 --rows ar:1,block:4,token:4,auto:1

Each prompt (N GSM8K + N HumanEval, 128 new tokens, EOS off) runs every row, in alternating order, with
the same seed. Prints each row's tokens/s (wall), the share of its wall time inside the base decoder's
``step`` (the rest: ``auto``'s policy work, the prefill, the loop around the steps), its tokens/s
inside the steps and the milliseconds its multi-path arms took; then, per row and arm, the iterations,
tokens per iteration and milliseconds per iteration, ``auto``'s iterations that follow another arm
("switch-in") apart.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from gbv.engine import tree_decoder
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--prompts", type=int, default=10, help="prompts per data set")
    parser.add_argument("--rows", default="ar:1,block:4,token:4,auto:1", help="method:L, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    rows = [(spec.split(":")[0], int(spec.split(":")[1])) for spec in args.rows.split(",")]
    current = [""]
    log: dict[tuple[str, str], list[tuple[int, float]]] = collections.defaultdict(list)
    step = tree_decoder.TreeDecoder.step

    def timed(self, block_len=None):
        start = time.perf_counter()
        new = step(self, block_len)
        seconds = time.perf_counter() - start
        arm = "ar" if block_len == 0 or self.method == "ar" else f"{self.method} K={self.num_paths} L={self.block_len}"
        switch_in = getattr(self, "_last_arm", None) != arm
        self._last_arm = arm
        log[(current[0], arm + (" (switch-in)" if switch_in and current[0] == "auto" else ""))].append(
            (len(new), seconds))
        return new

    tree_decoder.TreeDecoder.step = timed
    settings = dict(temperature=args.temperature, eos_token_id=[])
    for method, length in rows:  # warm-up (auto's policy sees 16 tokens first)
        generate(pair, prompt_ids=prompts[0], method=method, block_len=length, max_new_tokens=16, **settings)
    log.clear()
    wall, tokens = collections.Counter(), collections.Counter()
    for seed, ids in enumerate(prompts):
        for method, length in (rows if seed % 2 == 0 else rows[::-1]):
            current[0] = "auto" if method == "auto" else f"{method} L={length}"
            start = time.perf_counter()
            out = generate(pair, prompt_ids=ids, method=method, block_len=length, max_new_tokens=128, seed=seed,
                           **settings)
            wall[current[0]] += time.perf_counter() - start
            tokens[current[0]] += out.stats.new_tokens
    print(f"{args.dtype}, T = {args.temperature}, {len(prompts)} prompts, 128 new tokens, 1 thread\n")
    print("| row | tokens/s | share in steps | tokens/s in steps | multi-path arms (ms) |\n|---|---:|---:|---:|---:|")
    for row in wall:
        items = [(arm, its) for (r, arm), its in log.items() if r == row]
        made = sum(n for _, its in items for n, _ in its)
        spent = sum(s for _, its in items for _, s in its)
        multi = sum(s for arm, its in items if "K=1" not in arm and arm != "ar" for _, s in its)
        print(f"| {row} | {tokens[row] / wall[row]:.1f} | {spent / wall[row]:.3f} | {made / spent:.0f} | "
              f"{multi * 1e3:.0f} |")
    print("\n| row | arm | iterations | tokens / iteration | ms / iteration | median ms |\n|---|---|---:|---:|---:|---:|")
    for (row, arm), its in sorted(log.items()):
        made, spent = sum(n for n, _ in its), sum(s for _, s in its)
        print(f"| {row} | {arm} | {len(its)} | {made / len(its):.2f} | {spent / len(its) * 1e3:.2f} | "
              f"{statistics.median(s for _, s in its) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
