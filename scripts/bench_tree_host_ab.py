#!/usr/bin/env python3
"""Before/after in one run (1 thread, bundled pair): the tree engine's host work around the forwards
as of an earlier commit against the working tree, switched per prompt, interleaved: the trie of the
drafted paths (``gbv.engine.tree.build_tree``) and the commit's cache moves (``KVCache.move``).

    python scripts/bench_tree_host_ab.py --before b36eb97                  # bf16, 10 + 10 prompts
    python scripts/bench_tree_host_ab.py --before b36eb97 --dtype float32

"Before" is ``build_tree`` and ``KVCache.move`` loaded from ``git show REV:...`` under other names
and patched into the tree decoder and the cache class for its prompts. Prints tokens/s per row with
either variant, their ratio, the share of the wall time outside the draft, target and verify phases,
and on how many prompts both made the same tokens (they must: neither changes what is computed). The
loop and the table are scripts/bench_verify_kernels_ab.py's :func:`interleaved_ab` and
:func:`print_ab_table`.
"""

from __future__ import annotations

import argparse

import gbv.engine.tree_decoder as tree_decoder
from gbv.engine.lean import KVCache

from bench_engine_ab import load_before  # scripts/ is on the path when run as a script
from bench_verify_kernels_ab import interleaved_ab, print_ab_table

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

    def use(after: bool) -> None:
        tree_decoder.build_tree, KVCache.move = variants[after]

    header, sums, same = interleaved_ab(args.dtype, args.prompts, args.max_new_tokens, ROWS, use)
    print(f"{header}, before = {args.before}\n")
    print_ab_table(sums, same, ROWS, args.prompts, ("before", "after"), [("other share", 4, ".1%")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
