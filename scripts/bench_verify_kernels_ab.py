#!/usr/bin/env python3
"""Before/after in one run (1 thread, bundled pair): the verifiers' host forms with the compiled helpers
of gbv/verify/_verify_kernels.c (gbv-adaptive's node-weight search, bucket masses, the exact ranks among
a few tokens, TorchRandom.sample's draw) against the numpy code, switched per prompt, interleaved.

    python scripts/bench_verify_kernels_ab.py                     # bf16, 10 GSM8K + 10 HumanEval prompts
    python scripts/bench_verify_kernels_ab.py --dtype float32 --prompts 5

Prints, per (temperature, row): tokens/s with and without the kernels (pooled over the prompts), their
ratio, the verifier's share of the wall time either way, the share of the forwards (draft and
target phases, as scripts/bench_engine.py), and on how many prompts the two made the same tokens (the helpers give the numpy code's
bits, or its weights to rounding, so the same seeds should make the same tokens).
"""

from __future__ import annotations

import argparse

import torch

import gbv
from gbv.data import load_prompts
from gbv.verify import common, ranking

ROWS = [("block", 1, 4), ("gbv-adaptive", 3, 4), ("gbv-adaptive", 3, 8), ("gbv", 3, 8)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=10, help="GSM8K and as many HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    kernels = ranking.compiled_kernels
    if kernels is None:
        raise SystemExit("gbv.verify._verify_kernels is not built: reinstall gbv with a C compiler")
    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", dtype=args.dtype)
    prompts = load_prompts("gsm8k", args.prompts) + load_prompts("humaneval", args.prompts)
    gbv.generate(pair, prompt=prompts[0], method="gbv-adaptive", num_paths=3, block_len=4, max_new_tokens=16,
                 eos_token_id=[])  # warm-up
    print(f"{args.dtype}, {len(prompts)} prompts, {args.max_new_tokens} tokens, 1 thread\n")
    print("| T | row | tokens/s numpy | tokens/s compiled | ratio | verify share numpy / compiled "
          "| forwards share numpy / compiled | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for temperature in (0.2, 1.0):
        sums = {(row, on): [0, 0.0, 0.0, 0.0] for row in ROWS for on in (False, True)}
        same = {row: 0 for row in ROWS}
        for index, prompt in enumerate(prompts):
            for row in ROWS:
                method, num_paths, block_len = row
                tokens = {}
                for on in ((False, True) if index % 2 == 0 else (True, False)):
                    ranking.compiled_kernels = common._verify_kernels = kernels if on else None
                    out = gbv.generate(pair, prompt=prompt, method=method, num_paths=num_paths, block_len=block_len,
                                       temperature=temperature, max_new_tokens=args.max_new_tokens,
                                       eos_token_id=[], seed=index)
                    s = out.stats
                    total = sums[(row, on)]
                    total[0] += s.new_tokens
                    total[1] += s.time_total
                    total[2] += s.time_verify
                    total[3] += s.time_draft + s.time_target  # (the prefill's forwards are in these)
                    tokens[on] = list(out.token_ids)
                same[row] += tokens[False] == tokens[True]
        ranking.compiled_kernels = common._verify_kernels = kernels
        for row in ROWS:
            off, on = sums[(row, False)], sums[(row, True)]
            rate_off, rate_on = off[0] / off[1], on[0] / on[1]
            label = f"{row[0]} K={row[1]} L={row[2]}"
            print(f"| {temperature} | {label} | {rate_off:.1f} | {rate_on:.1f} | {rate_on / rate_off:.3f}x "
                  f"| {off[2] / off[1]:.0%} / {on[2] / on[1]:.0%} | {off[3] / off[1]:.0%} / {on[3] / on[1]:.0%} "
                  f"| {same[row]}/{len(prompts)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
