"""Before/after in one run (1 thread, bundled pair, float32): the lean forward with and without the
oneDNN-packed matrix copies (``gbv.engine.lean.packed_products_pay``), for batched decoding, where
every product has one row per sequence (or more), and for single sequences.

    python scripts/bench_packed_ab.py                    # 8 GSM8K + 8 HumanEval prompts, 96 tokens, T = 1

Each variant builds its own lean views (swapped into the engine's cache of them); the rows alternate
per round. Tokens/s are tokens over the wall time of each set, pooled over the rounds; the machine is shared, so only ratios within this
run mean anything.
"""
import argparse
import time

import torch

import gbv
import gbv.engine.lean as lean_module
import gbv.engine.tree_decoder as tree_decoder
from gbv.data import load_prompts

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--prompts", type=int, default=8, help="GSM8K and HumanEval prompts each (default 8)")
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--max-new-tokens", type=int, default=96)
args = parser.parse_args()

torch.set_num_threads(1)
pair = gbv.load_pair("bundled")
prompts = load_prompts("gsm8k", args.prompts) + load_prompts("humaneval", args.prompts)
real_pays = lean_module.packed_products_pay
views = {}
for name, pays in (("plain", lambda dtype, device: False), ("packed", real_pays)):
    lean_module.packed_products_pay = pays
    views[name] = {model: lean_module.LeanCausalLM(model) for model in (pair.target, pair.draft)}
lean_module.packed_products_pay = real_pays
rows = [("ar", 1, 1), ("ar", 1, 8), ("block", 4, 1), ("block", 4, 8), ("gbv", 8, 1)]
totals = {(row, name): [0, 0.0] for row in rows for name in views}
for round_index in range(args.rounds):
    order = list(views) if round_index % 2 == 0 else list(reversed(views))
    for row in rows:
        method, block_len, batch = row
        for name in order:
            for model, view in views[name].items():
                tree_decoder._LEAN[model] = view
            settings = dict(method=method, block_len=block_len, num_paths=3, temperature=1.0,
                            max_new_tokens=args.max_new_tokens, eos_token_id=[], seed=round_index)
            start = time.perf_counter()  # wall time of the whole set (a batch's rows overlap)
            if batch > 1:
                outs = gbv.generate(pair, prompts=prompts, batch_size=batch, **settings)
            else:
                outs = [gbv.generate(pair, prompt=prompt, **settings) for prompt in prompts]
            totals[(row, name)][1] += time.perf_counter() - start
            totals[(row, name)][0] += sum(out.stats.new_tokens for out in outs)
print(f"{len(prompts)} prompts, {args.max_new_tokens} tokens, T = 1, {args.rounds} rounds, 1 thread, float32")
print("| method | batch | plain tok/s | packed tok/s | packed / plain |")
print("|---|---:|---:|---:|---:|")
for row in rows:
    method, block_len, batch = row
    plain, packed = (totals[(row, name)][0] / totals[(row, name)][1] for name in ("plain", "packed"))
    label = method if method == "ar" else (f"{method} L={block_len}" if method == "block" else "gbv K=3 L=8")
    print(f"| {label} | {batch} | {plain:.1f} | {packed:.1f} | {packed / plain:.3f}x |")
