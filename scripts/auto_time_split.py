"""Where the wall time of ``auto`` and of fixed rows goes, in one run (1 thread, bundled pair).

    python scripts/auto_time_split.py --prompts 10 --temperature 0.2     # ~1 min
    python scripts/auto_time_split.py --rows ar,block:3,block:4,block:6,auto --dtype bfloat16

Each row runs every prompt (GSM8K and HumanEval, 128 new tokens, EOS off, the same seed per prompt,
rows in alternating order per prompt). Wrappers time the tree decoder's ``step`` (one iteration, of any
arm) and ``plain_steps`` (``auto``'s runs of ``ar`` steps: iterations too), ``prefill`` (the prompt
through the target, and the draft unless ``auto`` defers it), ``catch_up_draft`` (the draft fed its
deferred prompt or the tokens of ``auto``'s plain steps), and ``auto``'s ``choose`` and ``flush`` (its
policy: a choice, and the records it applies first). "other" is the rest of the wall time: the generate
loop, stop checks, detokenising. ``--learn N`` runs ``auto`` over the prompts N times first, so that the
timed pass runs a learnt policy. Reading: what a row's iterations cost against the best fixed row's, and
what the prompt's prefill and the policy add; ``auto``'s loss against the best
fixed row is the difference.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from gbv.engine import auto, tree_decoder
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids

PARTS = {"step": (tree_decoder.TreeDecoder, "step"), "plain": (tree_decoder.TreeDecoder, "plain_steps"),
         "prefill": (tree_decoder.TreeDecoder, "prefill"),
         "catch-up": (tree_decoder.TreeDecoder, "catch_up_draft"), "choose": (auto.AutoPolicy, "choose"),
         "flush": (auto.AutoPolicy, "flush")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", default="ar,block:3,block:4,block:6,auto",
                        help="ar, auto or block:L, comma-separated")
    parser.add_argument("--learn", type=int, default=0,
                        help="passes of auto over the prompts before the timed one (its policy learnt, not exploring)")
    args = parser.parse_args(argv)
    rows = []
    for row in args.rows.split(","):
        method, _, length = row.partition(":")
        if method not in ("ar", "auto", "block") or (method == "block") != length.isdigit():
            parser.error(f"bad row {row!r}: use ar, auto or block:L")
        rows.append((row, method, int(length or 1)))
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    spent: dict[tuple[str, str], float] = collections.defaultdict(float)
    current = [""]

    inside = collections.Counter()

    def timed(part: str, function):
        # (auto runs ar's stretches through plain_steps: iterations too)
        group = "policy" if part in ("choose", "flush") else "step" if part == "plain" else part

        def wrapper(*a, **k):  # (a call inside another of its group, as choose's flush, counts once)
            inside[group] += 1
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                inside[group] -= 1
                if not inside[group]:
                    spent[current[0], group] += time.perf_counter() - start
        return wrapper

    originals = {part: getattr(owner, name) for part, (owner, name) in PARTS.items()}
    for part, (owner, name) in PARTS.items():
        setattr(owner, name, timed(part, originals[part]))
    try:
        settings = dict(temperature=args.temperature, eos_token_id=[])
        for _, method, length in rows:  # warm-up (auto's policy sees these tokens before the timed run)
            generate(pair, prompt_ids=prompts[0], method=method, block_len=length, max_new_tokens=16, **settings)
        for _ in range(args.learn if any(method == "auto" for _, method, _ in rows) else 0):
            for seed, prompt_ids in enumerate(prompts):
                generate(pair, prompt_ids=prompt_ids, method="auto", max_new_tokens=128, seed=seed, **settings)
        spent.clear()
        wall = collections.defaultdict(float)
        tokens = collections.Counter()
        for seed, prompt_ids in enumerate(prompts):
            for label, method, length in (rows if seed % 2 == 0 else rows[::-1]):
                current[0] = label
                start = time.perf_counter()
                out = generate(pair, prompt_ids=prompt_ids, method=method, block_len=length, max_new_tokens=128,
                               seed=seed, **settings)
                wall[label] += time.perf_counter() - start
                tokens[label] += out.stats.new_tokens
    finally:
        for part, (owner, name) in PARTS.items():
            setattr(owner, name, originals[part])
    print(f"{args.dtype}, T = {args.temperature}, {len(prompts)} prompts x 128 tokens, 1 thread; ms in all\n")
    print("| row | tokens/s | wall | iterations (step) | prefill | draft catch-up | policy (choose + flush) | other |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, _, _ in rows:
        parts = [spent[label, part] for part in ("step", "prefill", "catch-up", "policy")]
        cells = " | ".join(f"{value * 1e3:.0f}" for value in (wall[label], *parts, wall[label] - sum(parts)))
        print(f"| {label} | {tokens[label] / wall[label]:.0f} | {cells} |")


if __name__ == "__main__":
    main()
