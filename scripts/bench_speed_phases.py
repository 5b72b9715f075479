"""How much do `ar` and BV move with the machine's moments, and does the one that is faster change? (1 thread, bundled pair)

    python scripts/bench_speed_phases.py                                # bfloat16, T = 0.2, BV L = 3
    python scripts/bench_speed_phases.py --dtype float32 --temperature 1.0 --block-len 4

Each prompt (``--prompts`` GSM8K + as many HumanEval, 128 new tokens, EOS off) runs ``ar`` and BV L =
``--block-len`` back to back (alternating which goes first), ``--repeats`` times over the prompts with the same
seeds: the same texts, the same tokens, so that what differs between the repeats of a prompt is the moment only.
For each run: ``ar``'s milliseconds a token and BV's. Prints the pooled rates (BV's tokens/s over ``ar``'s, after
the prefill), then, against each prompt's own mean over its repeats, how much each row's time moved from one moment
to another and the correlation of the two moves (shared moments move both), and the slope of each row's move on the
other's. Each slope is biased towards 0 by the other row's own noise, so together they only bracket how much more a
moment moves one row than the other.

Why: on a shared machine a step's time moves by tens of % within minutes (other tenants' use of the shared
last-level cache and memory), and rows that are tied on average (``ar`` and BV in bfloat16 here) swap places with
it. docs/ENGINE.md, "Why `auto` measures at 0.9-1.0x `ar` in bfloat16 here" (the fifty-first session).
"""
import argparse
import statistics

import torch

from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
parser.add_argument("--temperature", type=float, default=0.2)
parser.add_argument("--block-len", type=int, default=3)
parser.add_argument("--prompts", type=int, default=20, help="GSM8K and HumanEval prompts each (default 20)")
parser.add_argument("--repeats", type=int, default=3, help="passes over the prompts (the same seeds)")
args = parser.parse_args()
torch.set_num_threads(1)
pair = load_pair("bundled", dtype=args.dtype)
prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
settings = dict(temperature=args.temperature, eos_token_id=[], block_len=args.block_len, max_new_tokens=128)
for method in ("ar", "block"):  # (first calls: allocations)
    generate(pair, prompt_ids=prompts[0], method=method, **{**settings, "max_new_tokens": 16})


def run(method: str, prompt_ids: list[int], seed: int) -> tuple[int, float]:
    """Tokens, and seconds after the prefill (``time_total``: the generation after it)."""
    stats = generate(pair, prompt_ids=prompt_ids, method=method, seed=seed, **settings).stats
    return stats.new_tokens, stats.time_total


runs = []  # (prompt, ar's tokens, ar's seconds, BV's tokens, BV's seconds)
print(f"{args.dtype}, T = {args.temperature}, BV L = {args.block_len}, {len(prompts)} prompts x {args.repeats}")
for repeat in range(args.repeats):
    for index, prompt_ids in enumerate(prompts):
        order = ("ar", "block") if (index + repeat) % 2 == 0 else ("block", "ar")
        measured = {method: run(method, prompt_ids, index) for method in order}
        runs.append((index, *measured["ar"], *measured["block"]))
        (ar_tokens, ar_seconds), (bv_tokens, bv_seconds) = measured["ar"], measured["block"]
        print(f"prompt {index:2d} repeat {repeat}: ar {ar_seconds / ar_tokens * 1e3:.3f} ms a token, BV / ar "
              f"{bv_tokens / bv_seconds / (ar_tokens / ar_seconds):.3f}")


def pooled(members) -> float:
    """BV's tokens/s over ar's, each pooled over ``members``."""
    return (sum(r[3] for r in members) / sum(r[4] for r in members)) / (sum(r[1] for r in members)
                                                                       / sum(r[2] for r in members))


ms = [r[2] / r[1] * 1e3 for r in runs]
bv_ms = [r[4] / r[3] * 1e3 for r in runs]
by_prompt = {}
for i, r in enumerate(runs):
    by_prompt.setdefault(r[0], []).append(i)
ms_dev, bv_dev = [0.0] * len(runs), [0.0] * len(runs)
for members in by_prompt.values():
    for i in members:
        ms_dev[i] = ms[i] / statistics.mean(ms[j] for j in members) - 1
        bv_dev[i] = bv_ms[i] / statistics.mean(bv_ms[j] for j in members) - 1
print(f"pooled: BV / ar {pooled(runs):.3f}; ar {sum(r[2] for r in runs) / sum(r[1] for r in runs) * 1e3:.3f} ms a "
      f"token ({min(ms):.3f}-{max(ms):.3f})")
print(f"same texts, another moment: ar's ms a token moved by {statistics.mean(abs(d) for d in ms_dev):.1%} on average "
      f"from its prompt's mean (at most {max(abs(d) for d in ms_dev):.1%}), BV's by "
      f"{statistics.mean(abs(d) for d in bv_dev):.1%} (at most {max(abs(d) for d in bv_dev):.1%}); correlation of the "
      f"two moves {statistics.correlation(ms_dev, bv_dev):.2f}")
covariance = statistics.covariance(ms_dev, bv_dev)
print(f"BV's move per unit of ar's: {covariance / statistics.variance(ms_dev):.2f} (slope of BV on ar) to "
      f"{statistics.variance(bv_dev) / covariance:.2f} (1 / slope of ar on BV)")
