#!/usr/bin/env python3
"""Before/after in one run (1 thread, bundled pair): the tree engine's host work around the forwards
as of an earlier commit against the working tree, switched per prompt, interleaved: the trie of the
drafted paths (``gbv.engine.tree.build_tree``) and the commit's cache moves (``KVCache.move``).

    python scripts/bench_tree_host_ab.py --before 3c1d0e8                  # bf16, 10 + 10 prompts
    python scripts/bench_tree_host_ab.py --before 3c1d0e8 --dtype float32

"Before" is ``build_tree`` and ``KVCache.move`` loaded from ``git show REV:...`` under other names
and patched into the tree decoder and the cache class for its prompts. Prints tokens/s per row with
either variant, their ratio, the share of the wall time outside the draft, target and verify phases,
and on how many prompts both made the same tokens (they must: neither changes what is computed).
"""

from __future__ import annotations

import argparse

import torch

import gbv
import gbv.engine.tree_decoder as tree_decoder
from gbv.data import load_prompts
from gbv.engine.lean import KVCache

from bench_engine_ab import load_before  # scripts/ is on the path when run as a script

ROWS = [("gbv", 3, 8), ("gbv-adaptive", 3, 4), ("traversal", 3, 4), ("block", 1, 4)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision of the 'before' variant")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=10, help="GSM8K and as many HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    variants = {
        False: (load_before(args.before, "gbv/engine/tree.py", "tree_before").build_tree,
                load_before(args.before, "gbv/engine/lean.py", "lean_before").KVCache.move),
        True: (tree_decoder.build_tree, KVCache.move),
    }
    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", dtype=args.dtype)
    prompts = load_prompts("gsm8k", args.prompts) + load_prompts("humaneval", args.prompts)
    gbv.generate(pair, prompt=prompts[0], method="gbv", num_paths=3, block_len=4, max_new_tokens=16,
                 eos_token_id=[])  # warm-up
    print(f"{args.dtype}, {len(prompts)} prompts, {args.max_new_tokens} tokens, 1 thread, before = {args.before}\n")
    print("| T | row | tokens/s before | tokens/s after | ratio | other share before / after | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for temperature in (0.2, 1.0):
        sums = {(row, after): [0, 0.0, 0.0] for row in ROWS for after in (False, True)}
        same = {row: 0 for row in ROWS}
        for index, prompt in enumerate(prompts):
            for row in ROWS:
                method, num_paths, block_len = row
                tokens = {}
                for after in ((False, True) if index % 2 == 0 else (True, False)):
                    tree_decoder.build_tree, KVCache.move = variants[after]
                    out = gbv.generate(pair, prompt=prompt, method=method, num_paths=num_paths, block_len=block_len,
                                       temperature=temperature, max_new_tokens=args.max_new_tokens,
                                       eos_token_id=[], seed=index)
                    s = out.stats
                    total = sums[(row, after)]
                    total[0] += s.new_tokens
                    total[1] += s.time_total
                    total[2] += s.time_other
                    tokens[after] = list(out.token_ids)
                same[row] += tokens[False] == tokens[True]
        tree_decoder.build_tree, KVCache.move = variants[True]
        for row in ROWS:
            before, after = sums[(row, False)], sums[(row, True)]
            rate_before, rate_after = before[0] / before[1], after[0] / after[1]
            print(f"| {temperature} | {row[0]} K={row[1]} L={row[2]} | {rate_before:.1f} | {rate_after:.1f} "
                  f"| {rate_after / rate_before:.3f}x | {before[2] / before[1]:.1%} / {after[2] / after[1]:.1%} "
                  f"| {same[row]}/{len(prompts)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
