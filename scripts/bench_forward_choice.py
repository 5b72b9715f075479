"""The CPU forward the engine chooses (measured, ``choose_cpu_forward``) against the host forward with
its compiled products kept everywhere (``GBV_HOST_FORWARD=1``, the rule before), in one process,
bundled pair.

    python scripts/bench_forward_choice.py                       # float32, 3 + 3 prompts, 128 tokens
    python scripts/bench_forward_choice.py --dtype bfloat16 --prompts 5

The pair is loaded twice, so each variant has its own models, lean views and ``auto`` policy; the
variants alternate per prompt (drift hits both alike), 1 thread, EOS off. Prints what each lean view
measured when it was made (one-token step, host forward against torch's, and the choice), then pooled
tokens/s of each row with each variant and their ratio.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import gbv
from gbv.data import load_prompts
from gbv.engine.tree_decoder import lean_model

ROWS = (("ar", 1, 1), ("block", 1, 4), ("gbv", 3, 8), ("traversal", 3, 4), ("auto", 0, 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=3, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", default="0.2,1.0")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pairs = {}
    for variant, setting in (("host kept", "1"), ("measured", None)):
        if setting is None:
            os.environ.pop("GBV_HOST_FORWARD", None)
        else:
            os.environ["GBV_HOST_FORWARD"] = setting
        pair = pairs[variant] = gbv.load_pair("bundled", dtype=getattr(torch, args.dtype))
        for name, model in (("target", pair.target), ("draft", pair.draft)):
            lean = lean_model(model)
            times = lean.forward_times
            measured = ("not measured" if times is None
                        else ", ".join(f"{form} {ms:.3f} ms" for form, ms in times.items()))
            print(f"{variant}: {name} one-token steps {measured}; runs the {lean.forward_choice}")
    os.environ.pop("GBV_HOST_FORWARD", None)
    prompts = load_prompts("gsm8k", args.prompts) + load_prompts("humaneval", args.prompts)
    variants = list(pairs)
    for temperature in (float(t) for t in args.temperature.split(",")):
        totals: dict = {}
        for index, prompt in enumerate(prompts):
            for variant in (variants if index % 2 == 0 else variants[::-1]):
                for method, k, length in ROWS:
                    shape = dict(num_paths=k, block_len=length) if k else {}
                    if index == 0:  # (a warm-up generation per row and variant, untimed)
                        gbv.generate(pairs[variant], prompt=prompt, method=method, temperature=temperature,
                                     max_new_tokens=16, eos_token_id=[], seed=99, **shape)
                    began = time.perf_counter()
                    out = gbv.generate(pairs[variant], prompt=prompt, method=method, temperature=temperature,
                                       max_new_tokens=args.max_new_tokens, eos_token_id=[], seed=index, **shape)
                    tokens, seconds = totals.get((method, k, length, variant), (0, 0.0))
                    totals[(method, k, length, variant)] = (tokens + out.stats.new_tokens,
                                                            seconds + time.perf_counter() - began)
        print(f"\n{args.dtype}, T = {temperature}: {len(prompts)} prompts x {args.max_new_tokens} tokens, pooled tokens/s")
        print("| row | host kept | measured | measured / host kept |\n|---|---:|---:|---:|")
        for method, k, length in ROWS:
            kept, chosen = (totals[(method, k, length, v)][0] / totals[(method, k, length, v)][1] for v in variants)
            label = method if method in ("ar", "auto") else f"{method} K={k} L={length}"
            print(f"| {label} | {kept:.1f} | {chosen:.1f} | {chosen / kept:.3f}x |")


if __name__ == "__main__":
    main()
