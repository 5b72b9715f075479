"""BV's two forms in the engine, in one run: the host form (``block_verify_host``, what the CPU runs)
against the device form (``block_verify_on_device``, forced on the CPU as a GPU would run it).

    python scripts/bench_block_forms.py --prompts 5     # 5 GSM8K + 5 HumanEval prompts, ~3 min

Bundled pair, 1 thread, 128 new tokens, EOS off; per prompt both forms run every row with the same
seed, in alternating order. Prints per row and form: verify ms per iteration (the engine's own
clock), tokens per iteration and pooled tokens/s. The two forms draw their coins differently, so
their tokens differ after the first rejection; the verify time per iteration is the direct measure.
"""
from __future__ import annotations

import argparse
import time

import torch

import gbv.verify.block as block
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids

ROWS = [("block", 4), ("block", 8)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", default="0.2,1.0")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype="float32")
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    host_rule = block.uses_device_form
    print("| row | T | form | verify ms / iteration | tokens / iteration | tokens/s |")
    print("|---|---|---|---:|---:|---:|")
    for temperature in [float(t) for t in args.temperature.split(",")]:
        settings = dict(temperature=temperature, eos_token_id=[], max_new_tokens=args.max_new_tokens)
        generate(pair, prompt_ids=prompts[0], method="block", block_len=4, **{**settings, "max_new_tokens": 16})
        totals: dict[tuple, list[float]] = {}
        for index, prompt_ids in enumerate(prompts):
            for form in (("host", "device") if index % 2 == 0 else ("device", "host")):
                block.uses_device_form = host_rule if form == "host" else (lambda p: True)
                for method, length in ROWS:
                    start = time.perf_counter()
                    out = generate(pair, prompt_ids=prompt_ids, method=method, block_len=length, seed=index,
                                   **settings)
                    seconds = time.perf_counter() - start
                    stats = out.stats
                    row = totals.setdefault((method, length, form), [0.0, 0.0, 0.0, 0.0])
                    row[0] += stats.time_verify
                    row[1] += stats.target_calls
                    row[2] += len(out.token_ids)
                    row[3] += seconds
        block.uses_device_form = host_rule
        for method, length in ROWS:
            for form in ("device", "host"):
                verify, calls, tokens, seconds = totals[method, length, form]
                print(f"| {method} L={length} | {temperature} | {form} | {1e3 * verify / calls:.3f} | "
                      f"{tokens / calls:.2f} | {tokens / seconds:.1f} |")


if __name__ == "__main__":
    main()
