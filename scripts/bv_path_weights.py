"""BV's path weights against its accepted lengths on the bundled pair (1 thread), per block length.

    python scripts/bv_path_weights.py --dtype float32 --temperature 0.2 --prompts 10

For each BV block length L run alone (N GSM8K + N HumanEval prompts, 128 tokens, EOS off), every
iteration's accepted length tau and path weights w_1..w_L (gbv.verify.block.path_weights):

- tokens an iteration, 1 + mean tau, against 1 + mean sum_i w_i: the same expectation
  (P(tau >= i | x_1..x_i) = w_i, tests/verify/test_block_weights.py), so they differ by noise only;
- the standard error of both estimates of the tokens an iteration;
- the share of iterations in which the accepted lengths observe the last depth (tau >= L - 1), where the
  weights observe every depth of every iteration.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import gbv
from gbv.engine import decoder
from gbv.verify.block import path_weights
from prompt_sets import benchmark_prompts

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--dtype", default="float32")
parser.add_argument("--temperature", type=float, default=0.2)
parser.add_argument("--prompts", type=int, default=10, help="GSM8K and HumanEval prompts each")
parser.add_argument("--blocks", default="2,4,8")
args = parser.parse_args()

torch.set_num_threads(1)
pair = gbv.load_pair("bundled", dtype=args.dtype)
prompts = benchmark_prompts(args.prompts)
log: list[tuple[int, list[float]]] = []
verify = decoder.DecoderState.verify


def logged_verify(self, drafted, q, p, since):
    result = verify(self, drafted, q, p, since)
    log.append((result.accepted_len, path_weights(drafted[0], q[0], p[0])))
    return result


decoder.DecoderState.verify = logged_verify
print(f"BV on the bundled pair, {args.dtype}, T = {args.temperature}, {len(prompts)} prompts x 128 tokens\n")
print("| L | iterations | 1 + mean tau | 1 + mean sum w | std. error, tau / w | tau observes depth L |")
print("|---|---:|---:|---:|---:|---:|")
for block_len in (int(b) for b in args.blocks.split(",")):
    log.clear()
    for seed, prompt in enumerate(prompts):
        gbv.generate(pair, prompt=prompt, method="block", block_len=block_len, temperature=args.temperature,
                     max_new_tokens=128, eos_token_id=[], seed=seed)
    taus = [tau for tau, _ in log]
    sums = [sum(weights) for _, weights in log]
    error = [statistics.stdev(x) / len(x) ** 0.5 for x in (taus, sums)]
    last = sum(tau >= block_len - 1 for tau in taus) / len(taus)
    print(f"| {block_len} | {len(log)} | {1 + statistics.fmean(taus):.3f} | {1 + statistics.fmean(sums):.3f} | "
          f"{error[0]:.3f} / {error[1]:.3f} | {last:.0%} |", flush=True)
