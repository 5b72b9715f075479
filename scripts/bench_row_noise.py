"""How much one fixed row of the engine table moves with the sampling seeds alone (1 thread,
bundled pair): the same method, K, L and prompts, run with ``--seed-sets`` sets of seeds (prompt
``i`` gets seed ``i + 1000 s`` in set ``s``; the table uses set 0), interleaved per prompt so that the
machine's drift falls on every set alike. What differs between the sets is the sampled text, and
with it how far the drafts are accepted.

Why: ``auto``'s share of the best fixed row is a ratio of two such rows, and the best fixed row is
the largest of a dozen, each with this noise, so it is biased upwards by the noise itself.

    python scripts/bench_row_noise.py                                   # BV L = 6, T = 0.2, 5 seed sets
    python scripts/bench_row_noise.py --method block --block-len 8 --temperature 1.0
"""
import argparse
import statistics

import torch

import gbv
from prompt_sets import benchmark_prompts

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--method", default="block")
parser.add_argument("--num-paths", type=int, default=1)
parser.add_argument("--block-len", type=int, default=6)
parser.add_argument("--temperature", type=float, default=0.2)
parser.add_argument("--prompts", type=int, default=20, help="GSM8K and HumanEval prompts each (default 20)")
parser.add_argument("--seed-sets", type=int, default=5)
parser.add_argument("--dtype", default="float32")
args = parser.parse_args()

torch.set_num_threads(1)
pair = gbv.load_pair("bundled", dtype=args.dtype)
prompts = benchmark_prompts(args.prompts)
gbv.generate(pair, prompt=prompts[0], method="block", block_len=2, max_new_tokens=8, eos_token_id=[])
totals = [[0, 0.0, 0] for _ in range(args.seed_sets)]
for index, prompt in enumerate(prompts):
    for seed_set, total in enumerate(totals):
        out = gbv.generate(pair, prompt=prompt, method=args.method, num_paths=args.num_paths,
                           block_len=args.block_len, temperature=args.temperature, max_new_tokens=128,
                           eos_token_id=[], seed=index + 1000 * seed_set)
        total[0] += out.stats.new_tokens
        total[1] += out.stats.time_total
        total[2] += out.stats.to_dict()["target_calls"]
print(f"{args.method} K={args.num_paths} L={args.block_len}, T = {args.temperature}, {args.dtype}, "
      f"{len(prompts)} prompts, 128 tokens, 1 thread")
print("| seed set | tokens/s | tokens per target call | ms per target call |")
print("|---|---:|---:|---:|")
for seed_set, (tokens, seconds, calls) in enumerate(totals):
    print(f"| {seed_set} | {tokens / seconds:.1f} | {tokens / calls:.3f} | {1e3 * seconds / calls:.2f} |")
rates = [tokens / seconds for tokens, seconds, _ in totals]
print(f"\ntokens/s: {min(rates):.1f} to {max(rates):.1f} (max / min {max(rates) / min(rates):.3f}, "
      f"median {statistics.median(rates):.1f})")
