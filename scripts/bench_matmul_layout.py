"""Before/after in one run (1 thread, bundled pair): the lean forward's matrix products as the
plain ``F.linear`` over the Hugging Face weights, against what ``gbv.engine.lean`` chooses on this
machine: in float32, contiguous transposed (in, out) copies (``transposed_weights_pay``); in
bfloat16, products of several rows computed in float32 (``bf16_products_upcast``).

    python scripts/bench_matmul_layout.py                    # 10 GSM8K + 10 HumanEval prompts, ~5 min
    python scripts/bench_matmul_layout.py --prompts 3        # a quick look
    python scripts/bench_matmul_layout.py --dtype bfloat16   # the bf16 choice (~3x as long)

1. The target's matrix multiplies alone (the forward's own ``_Linear`` objects), for 1 to 25 rows.
2. A forward of the lean target and draft over a 128-token prefix, for 1, 5 and 25 new tokens.
3. The engine: tokens/s of ``ar``, ``block`` L=4 and ``gbv`` K=3 L=8 with each layout, interleaved
   per prompt (each variant's lean views are swapped into the engine's cache of them).
Medians over repeats; the machine is shared, so only ratios within this run mean anything.
"""
import argparse
import statistics
import time

import torch

import gbv
import gbv.engine.lean as lean_module
import gbv.engine.tree_decoder as tree_decoder
from gbv.engine.lean import LeanCausalLM

from bench_engine import _median_ms  # scripts/ is on the path when run as a script
from prompt_sets import benchmark_prompts


def views(pair) -> dict:
    """{"before" | "after": {model: LeanCausalLM}} with the layout choices off / as on this machine."""
    chosen = lean_module.transposed_weights_pay, lean_module.bf16_products_upcast
    out = {}
    try:
        for name, flag in (("before", False), ("after", True)):
            lean_module.transposed_weights_pay = lambda dtype, device, flag=flag: flag and chosen[0](dtype, device)
            lean_module.bf16_products_upcast = lambda dtype, device, flag=flag: flag and chosen[1](dtype, device)
            out[name] = {model: LeanCausalLM(model) for model in (pair.target, pair.draft)}
    finally:
        lean_module.transposed_weights_pay, lean_module.bf16_products_upcast = chosen
    return out


def median_ms(fn, inner: int = 20, repeats: int = 7) -> float:
    return _median_ms(fn, repeats, inner)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", dtype=args.dtype)
    layouts = views(pair)
    with torch.inference_mode():
        print("| target matmuls, rows | before ms | after ms | before/after |\n|---|---:|---:|---:|")
        for rows in (1, 2, 5, 9, 25):
            times = {}
            for name, lean in layouts.items():
                matrices = lean[pair.target].matrices()
                inputs = {m.in_features: torch.randn(1, rows, m.in_features, dtype=pair.target.dtype)
                          for m in matrices}
                times[name] = median_ms(lambda: [m(inputs[m.in_features]) for m in matrices])
            print(f"| {rows} | {times['before']:.2f} | {times['after']:.2f} | {times['before'] / times['after']:.2f} |")
        print("\n| forward (prefix 128) | before ms | after ms | before/after |\n|---|---:|---:|---:|")
        prefix = 128
        for role, model in (("target", pair.target), ("draft", pair.draft)):
            caches = {}
            for name, lean in layouts.items():
                caches[name] = lean[model].new_cache(1, 512)
                lean[model].forward(torch.arange(prefix)[None] % 100, torch.arange(prefix)[None], 0, caches[name],
                                    None, causal=True)
            for n in (1, 5, 25):
                tokens, positions = torch.full((1, n), 7), prefix + torch.arange(n)[None]
                mask = torch.ones(1, 1, n, prefix + n, dtype=torch.bool) if n > 1 else None
                times = {name: [] for name in layouts}
                for _ in range(5):  # alternate the layouts, several rounds
                    for name, lean in layouts.items():
                        times[name].append(median_ms(
                            lambda: lean[model].forward(tokens, positions, prefix, caches[name], mask), repeats=1))
                before, after = statistics.median(times["before"]), statistics.median(times["after"])
                print(f"| {role}, {n} new token(s) | {before:.2f} | {after:.2f} | {before / after:.2f} |")
    rows = [("ar", 1, 1), ("block", 1, 4), ("gbv", 3, 8)]
    prompts = benchmark_prompts(args.prompts)
    rate = {}
    for temperature in (0.2, 1.0):
        for index, prompt in enumerate(prompts):
            for name, lean in layouts.items():
                tree_decoder._LEAN.update(lean)
                for method, k, length in rows:
                    out = gbv.generate(pair, prompt=prompt, method=method, num_paths=k, block_len=length,
                                       temperature=temperature, max_new_tokens=args.max_new_tokens,
                                       eos_token_id=[], seed=index)
                    rate.setdefault((temperature, method, k, length, name), []).append(
                        (out.stats.new_tokens, out.stats.time_total))
    tree_decoder._LEAN.clear()
    print(f"\n{args.dtype}, {len(prompts)} prompts, {args.max_new_tokens} new tokens, EOS off, 1 thread, "
          "pooled tokens / seconds.\n")
    print("| method | T | before tok/s | after tok/s | after/before |\n|---|---|---:|---:|---:|")
    for temperature in (0.2, 1.0):
        for method, k, length in rows:
            pooled = {}
            for name in layouts:
                results = rate[(temperature, method, k, length, name)]
                pooled[name] = sum(r[0] for r in results) / sum(r[1] for r in results)
            label = method if method == "ar" else f"{method} K={k} L={length}"
            print(f"| {label} | {temperature} | {pooled['before']:.1f} | {pooled['after']:.1f} | "
                  f"{pooled['after'] / pooled['before']:.3f} |")


if __name__ == "__main__":
    main()
