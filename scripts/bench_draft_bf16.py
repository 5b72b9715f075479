"""A float32 draft drafting with bfloat16-rounded weights (``tree_decoder.draft_lean_model``) against the
float32 draft, in one process (bundled pair, float32, 1 thread, CPU).

    python scripts/bench_draft_bf16.py                 # 5 GSM8K + 5 HumanEval prompts, 128 tokens
    python scripts/bench_draft_bf16.py --prompts 10

1. A draft step of each view after a 64-token prefix (medians of 7 rounds of 50, alternating).
2. Whole generations of the speculative rows and ``auto``, the two drafts alternating per prompt (the
   engine's cache of draft views is pointed at one or the other), T = 0.2 and 1: pooled tokens/s,
   block efficiency (the rounded draft's laws differ a little, and so does what the target accepts)
   and milliseconds per iteration. Decoding is lossless with either draft.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import gbv
import gbv.engine.tree_decoder as tree_decoder
from prompt_sets import benchmark_prompt_ids

ROWS = (("token", 1, 4), ("block", 1, 2), ("block", 1, 4), ("block", 1, 8), ("gbv", 3, 8), ("traversal", 3, 4),
        ("auto", 1, 1))
KINDS = ("float32 draft", "bf16-rounded draft")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled")
    plain = tree_decoder.lean_model(pair.draft)
    rounded = tree_decoder.draft_lean_model(pair.draft, pair.target)
    if rounded is plain:
        raise SystemExit("bench_draft_bf16: the draft is not rounded here (no compiled products, or GBV_DRAFT_BF16=0)")
    views = dict(zip(KINDS, (plain, rounded)))

    # 1. A draft step.
    times: dict = {}
    with torch.inference_mode():
        caches = {kind: view.plain_cache(1, 256) for kind, view in views.items()}
        for kind, view in views.items():
            view.chain(list(range(1, 65)), 0, caches[kind])
        for _ in range(7):
            for kind, view in views.items():
                for _ in range(5):
                    view.chain([7], 64, caches[kind])
                began = time.perf_counter()
                for _ in range(50):
                    view.chain([7], 64, caches[kind])
                times.setdefault(kind, []).append((time.perf_counter() - began) / 50 * 1e3)
    print(" | ".join(f"{kind} step {statistics.median(times[kind]):.3f} ms" for kind in KINDS))

    # 2. Generations.
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    for temperature in (0.2, 1.0):
        totals: dict = {}
        for index, ids in enumerate(prompts):
            for method, k, length in ROWS:
                for kind in (KINDS if index % 2 == 0 else KINDS[::-1]):
                    tree_decoder._DRAFT_LEAN[pair.draft] = views[kind]
                    began = time.perf_counter()
                    out = gbv.generate(pair, prompt_ids=ids, method=method, num_paths=k, block_len=length,
                                       max_new_tokens=args.max_new_tokens, temperature=temperature, eos_token_id=[],
                                       seed=index)
                    total = totals.setdefault((method, k, length, kind), [0.0, 0, 0])
                    total[0] += time.perf_counter() - began
                    total[1] += out.stats.new_tokens
                    total[2] += out.stats.target_calls
        tree_decoder._DRAFT_LEAN[pair.draft] = rounded
        print(f"\nT = {temperature}, {len(prompts)} prompts x {args.max_new_tokens} tokens (float32 -> bf16-rounded draft)")
        print("| row | tokens/s | ratio | block efficiency | ms/iteration | ratio |\n|---|---|---:|---|---|---:|")
        for method, k, length in ROWS:
            (sa, ta, ca), (sb, tb, cb) = (totals[method, k, length, kind] for kind in KINDS)
            label = method if method == "auto" else f"{method} K={k} L={length}"
            print(f"| {label} | {ta / sa:.0f} -> {tb / sb:.0f} | {(tb / sb) / (ta / sa):.3f}x | {ta / ca:.2f} -> "
                  f"{tb / cb:.2f} | {1e3 * sa / ca:.2f} -> {1e3 * sb / cb:.2f} | {(sa / ca) / (sb / cb):.3f}x |")


if __name__ == "__main__":
    main()
