"""The CPU forwards of a lean view against each other, in one process, bundled pair: what the engine's
measurement at load picks here (``choose_cpu_forward``, the default: the form and the compiled kernels'
prefetch hint), the host forward with its compiled products prefetching non-temporally
(``GBV_HOST_FORWARD=1``, the rule before this was measured), the host forward with torch's products
(``GBV_HOST_FORWARD=torch-products``) and torch's forward (``GBV_HOST_FORWARD=0``).

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
import gbv.engine.host_kernels as host_kernels
from gbv.engine.tree_decoder import lean_model
from prompt_sets import benchmark_prompts

ROWS = (("ar", 1, 1), ("block", 1, 4), ("gbv", 3, 8), ("traversal", 3, 4), ("auto", 0, 0))
FORMS = (("measured (default)", None), ("compiled products, non-temporal", "1"), ("torch's products", "torch-products"),
         ("torch forward", "0"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=3, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", default="0.2,1.0")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    pairs, hints = {}, {}
    for label, setting in FORMS:
        if setting is None:
            os.environ.pop("GBV_HOST_FORWARD", None)
        else:
            os.environ["GBV_HOST_FORWARD"] = setting
        pairs[label] = gbv.load_pair("bundled", dtype=dtype)
        for name, model in (("target", pairs[label].target), ("draft", pairs[label].draft)):
            lean = lean_model(model)  # (made now, under this form's setting)
            if setting is None:
                times = ", ".join(f"{form} {ms:.3f} ms" for form, ms in (lean.forward_times or {}).items())
                print(f"measured at load: {name} one-token steps {times or 'not measured'}; the engine runs the "
                      f"{lean.forward_choice}")
        # (the kernels' prefetch hint is process-wide: each form runs with its own)
        hints[label] = bool(host_kernels.prefetch_temporal()) if setting is None else False
    os.environ.pop("GBV_HOST_FORWARD", None)
    print(f"measured: the compiled kernels prefetch {'temporally' if hints[FORMS[0][0]] else 'non-temporally'}")
    prompts = benchmark_prompts(args.prompts)
    labels = list(pairs)
    for temperature in (float(t) for t in args.temperature.split(",")):
        totals: dict = {}
        for index, prompt in enumerate(prompts):
            for label in labels[index % len(labels):] + labels[:index % len(labels)]:
                if host_kernels.host_kernels_unavailable() is None:
                    host_kernels.set_prefetch_temporal(hints[label], chosen=False)
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
