"""The three CPU forwards of a lean view against each other, in one process, bundled pair: the host
forward with its compiled products (``GBV_HOST_FORWARD=1``, the rule before this was measured), the
host forward with torch's products (``GBV_HOST_FORWARD=torch-products``) and torch's forward
(``GBV_HOST_FORWARD=0``); and which one the engine's measurement at load picks here
(``choose_cpu_forward``, the default).

    python scripts/bench_forward_choice.py                       # float32, 3 + 3 prompts, 128 tokens
    python scripts/bench_forward_choice.py --dtype bfloat16 --prompts 5

The pair is loaded once per form, so each has its own models, lean views and ``auto`` policy; the
forms alternate per prompt in rotating order (drift hits them alike), 1 thread, EOS off. Prints the
measurement's medians and choice, then per row and form pooled tokens/s, milliseconds per iteration
(target call) and block efficiency. Compare forms by milliseconds per iteration where their random
streams differ: torch's forward takes the drafts' uniforms from another stream than the host
forward's (``draft_uniforms``), so its texts, and at low temperature its block efficiency, differ.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import gbv
from gbv.data import load_prompts
from gbv.engine.lean import LeanCausalLM
from gbv.engine.tree_decoder import lean_model

ROWS = (("ar", 1, 1), ("block", 1, 4), ("gbv", 3, 8), ("traversal", 3, 4), ("auto", 0, 0))
FORMS = (("compiled products", "1"), ("torch's products", "torch-products"), ("torch forward", "0"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=3, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", default="0.2,1.0")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    os.environ.pop("GBV_HOST_FORWARD", None)
    measured = gbv.load_pair("bundled", dtype=dtype)
    for name, model in (("target", measured.target), ("draft", measured.draft)):
        lean = LeanCausalLM(model)
        times = ", ".join(f"{form} {ms:.3f} ms" for form, ms in (lean.forward_times or {}).items())
        print(f"measured at load: {name} one-token steps {times or 'not measured'}; the engine runs the "
              f"{lean.forward_choice or 'torch forward'}")
    pairs = {}
    for label, setting in FORMS:
        os.environ["GBV_HOST_FORWARD"] = setting
        pairs[label] = gbv.load_pair("bundled", dtype=dtype)
        for model in (pairs[label].target, pairs[label].draft):
            lean_model(model)  # (made now, under this form's setting)
    os.environ.pop("GBV_HOST_FORWARD", None)
    prompts = load_prompts("gsm8k", args.prompts) + load_prompts("humaneval", args.prompts)
    labels = list(pairs)
    for temperature in (float(t) for t in args.temperature.split(",")):
        totals: dict = {}
        for index, prompt in enumerate(prompts):
            for label in labels[index % len(labels):] + labels[:index % len(labels)]:
                for method, k, length in ROWS:
                    shape = dict(num_paths=k, block_len=length) if k else {}
                    if index == 0:  # (a warm-up generation per row and form, untimed)
                        gbv.generate(pairs[label], prompt=prompt, method=method, temperature=temperature,
                                     max_new_tokens=16, eos_token_id=[], seed=99, **shape)
                    began = time.perf_counter()
                    out = gbv.generate(pairs[label], prompt=prompt, method=method, temperature=temperature,
                                       max_new_tokens=args.max_new_tokens, eos_token_id=[], seed=index, **shape)
                    seconds = time.perf_counter() - began
                    tokens, total, calls = totals.get((method, k, length, label), (0, 0.0, 0))
                    totals[(method, k, length, label)] = (tokens + out.stats.new_tokens, total + seconds,
                                                          calls + out.stats.target_calls)
        print(f"\n{args.dtype}, T = {temperature}: {len(prompts)} prompts x {args.max_new_tokens} tokens; "
              "tokens/s, ms per iteration, block efficiency")
        print("| row | " + " | ".join(labels) + " |\n|---|" + "---|" * len(labels))
        for method, k, length in ROWS:
            cells = []
            for label in labels:
                tokens, seconds, calls = totals[(method, k, length, label)]
                cells.append(f"{tokens / seconds:.1f} tok/s, {1e3 * seconds / calls:.2f} ms, {tokens / calls:.2f}")
            row = method if method in ("ar", "auto") else f"{method} K={k} L={length}"
            print(f"| {row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
