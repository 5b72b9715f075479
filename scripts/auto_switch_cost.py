"""What an iteration of each ``auto`` arm costs right after another arm (or a prefill) against right after
one of its own, on the bundled pair (1 thread, EOS off, 128 new tokens).

    python scripts/auto_switch_cost.py                    # bfloat16, 10 + 10 prompts at T = 0.2 and 1, ~1 min
    python scripts/auto_switch_cost.py --dtype float32

Runs ``method="auto"`` and logs every iteration the policy records (arm, seconds, whether the arm
before it was the same). Prints per arm the median and mean seconds of both kinds, and the median of
the paired differences (a switch-in iteration minus the next iteration of the same arm: measured at
the same machine speed), which is what ``AutoPolicy.switch_cost`` estimates (docs/ENGINE.md, "auto:
switching costs"). The seconds are those the policy sees, after its outlier cap.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from gbv.engine import auto
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=10, help="GSM8K and HumanEval prompts each")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    ids = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    log = []
    record = auto.AutoPolicy._record  # (every record goes through it, deferred or not)

    def logged(self, index, tokens, seconds, *rest):
        log.append((self.arms[index].label, index == self.previous, seconds))
        return record(self, index, tokens, seconds, *rest)

    auto.AutoPolicy._record = logged
    for temperature in (0.2, 1.0):
        for seed, prompt_ids in enumerate(ids):
            generate(pair, prompt_ids=prompt_ids, method="auto", temperature=temperature, max_new_tokens=128,
                     eos_token_id=[], seed=seed)
    auto.AutoPolicy._record = record
    pairs, kinds = {}, {}
    for (first, first_same, first_s), (second, second_same, second_s) in zip(log, log[1:]):
        if first == second and not first_same and second_same:
            pairs.setdefault(first, []).append(first_s - second_s)
    for label, same, seconds in log:
        kinds.setdefault(label, {}).setdefault(same, []).append(seconds)
    print("| arm | after itself: n, median ms | after another arm: n, median ms | pairs: n, median difference ms |")
    print("|---|---:|---:|---:|")
    for label, by in kinds.items():
        own, other, diffs = by.get(True, []), by.get(False, []), pairs.get(label, [])
        cell = lambda v: f"{len(v)}, {statistics.median(v) * 1e3:.3f}" if v else "0, -"
        print(f"| {label} | {cell(own)} | {cell(other)} | {cell(diffs)} |")


if __name__ == "__main__":
    main()
