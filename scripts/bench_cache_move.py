"""A commit's cache moves through one compiled call (host_kernels.move_slots) against numpy's assignment
per array, in one process (bundled pair, 1 thread), the two forms alternating per prompt.

    python scripts/bench_cache_move.py --dtype bfloat16 --rows gbv-adaptive:3:4,gbv:3:4 --prompts 10

Per row and form: the mean microseconds of a ``KVCache.move`` call in the engine (a commit's move of the
target's cache, or the draft's), the moves per iteration, ms per iteration, tokens/s and the forwards'
share of the wall time (draft + target time over the total, as scripts/bench_engine.py reports it).
One path (BV) never moves: its nodes are already in place. The machine is shared: compare the two
forms within one run only.
"""

from __future__ import annotations

import argparse
import time

import torch

import gbv
from gbv.engine import lean
from prompt_sets import benchmark_prompts

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--prompts", type=int, default=10, help="GSM8K and HumanEval prompts each")
parser.add_argument("--rows", default="gbv-adaptive:3:4,gbv:3:4,traversal:3:4,gbv-adaptive:3:8")
args = parser.parse_args()

torch.set_num_threads(1)
pair = gbv.load_pair("bundled", dtype=args.dtype)
prompts = benchmark_prompts(args.prompts)
form = {"compiled": True}
moves = {"calls": 0, "seconds": 0.0}
plain_move = lean.KVCache.move


def timed_move(self, src, dst, row=0):
    if self._arrays is not None:
        self._compiled_moves = form["compiled"]
    start = time.perf_counter()
    plain_move(self, src, dst, row)
    moves["seconds"] += time.perf_counter() - start
    moves["calls"] += 1


lean.KVCache.move = timed_move
forms = {"compiled": True, "numpy": False}
print(f"KVCache.move in the engine, {args.dtype}, T = {args.temperature}, {len(prompts)} prompts x 128 tokens, "
      "forms alternating per prompt\n")
print("| row | form | us / move | moves / iteration | ms / iteration | tokens/s | forwards' share |")
print("|---|---|---:|---:|---:|---:|---:|")
for row in args.rows.split(","):
    method, num_paths, block_len = row.split(":")
    settings = dict(method=method, num_paths=int(num_paths), block_len=int(block_len), temperature=args.temperature,
                    max_new_tokens=128, eos_token_id=[])
    gbv.generate(pair, prompt=prompts[0], **{**settings, "max_new_tokens": 16})
    sums = {name: dict(calls=0, move_s=0.0, iterations=0, tokens=0, seconds=0.0, forwards=0.0) for name in forms}
    for seed, prompt in enumerate(prompts):
        for name in (forms if seed % 2 == 0 else list(forms)[::-1]):
            form["compiled"] = forms[name]
            moves.update(calls=0, seconds=0.0)
            stats = gbv.generate(pair, prompt=prompt, seed=seed, **settings).stats
            s = sums[name]
            s["calls"] += moves["calls"]
            s["move_s"] += moves["seconds"]
            s["iterations"] += stats.target_calls
            s["tokens"] += stats.new_tokens
            s["seconds"] += stats.time_total
            s["forwards"] += stats.time_draft + stats.time_target
    for name, s in sums.items():
        print(f"| {row} | {name} | {s['move_s'] / max(s['calls'], 1) * 1e6:.1f} | {s['calls'] / s['iterations']:.2f} | "
              f"{s['seconds'] / s['iterations'] * 1e3:.3f} | {s['tokens'] / s['seconds']:.1f} | "
              f"{s['forwards'] / s['seconds']:.1%} |", flush=True)
