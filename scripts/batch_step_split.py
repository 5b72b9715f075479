"""Where a batched step's time goes: the model forwards against the host work around them (draws,
masks, tries, verification, commits), per ``BatchTreeDecoder.step``, bundled pair, 1 thread.

    python scripts/batch_step_split.py --row block:4 --dtype bfloat16
    python scripts/batch_step_split.py --row ar --batch-size 16 --rounds 5

Runs ``generate(prompts=..., batch_size=B)`` over ``--prompts`` GSM8K prompts (EOS off, T = 1 by
default) once to warm up, then ``--rounds`` times with every step and every host forward timed
(``time.perf_counter`` around them; the kernels run on the CPU, so no device sync is needed).
Prints, per round: tokens/s of the whole call, steps, ms per step, and ms per step outside the
forwards (the step's host work); then the medians.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import gbv
from gbv.data import load_prompts
from gbv.engine import batch as batch_module
from gbv.engine import lean_host

from bench_rev_ab import parse_row  # scripts/ is on the path when run as a script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="block:4", help="ar, auto, METHOD:L or METHOD:K:L")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.batch_size < 2:
        parser.error("--batch-size must be at least 2 (one prompt at a time decodes on the single-sequence "
                     "decoder, which has no batched step to time)")
    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", dtype=getattr(torch, args.dtype))
    prompts = load_prompts("gsm8k", args.prompts)
    settings = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens, eos_token_id=[],
                    batch_size=args.batch_size, **parse_row(args.row))
    clock = {"step": 0.0, "forwards": 0.0, "steps": 0, "inside": False}
    step, forward = batch_module.BatchTreeDecoder.step, lean_host.HostForward._forward

    def timed_step(self, *a, **k):
        clock["inside"] = True
        began = time.perf_counter()
        try:
            return step(self, *a, **k)
        finally:
            clock["step"] += time.perf_counter() - began
            clock["steps"] += 1
            clock["inside"] = False

    def timed_forward(self, *a, **k):
        began = time.perf_counter()
        try:
            return forward(self, *a, **k)
        finally:
            if clock["inside"]:  # (a prompt's prefill is not a step's)
                clock["forwards"] += time.perf_counter() - began

    batch_module.BatchTreeDecoder.step, lean_host.HostForward._forward = timed_step, timed_forward
    gbv.generate(pair, prompts=prompts, seed=0, **settings)
    rates, per_step, outside = [], [], []
    print(f"bundled pair, {args.dtype}, {args.row}, batch {args.batch_size}, T = {args.temperature}, "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens")
    for round_ in range(args.rounds):
        clock.update(step=0.0, forwards=0.0, steps=0)
        began = time.perf_counter()
        outs = gbv.generate(pair, prompts=prompts, seed=round_ + 1, **settings)
        seconds = time.perf_counter() - began
        rates.append(sum(out.stats.new_tokens for out in outs) / seconds)
        per_step.append(clock["step"] / clock["steps"] * 1e3)
        outside.append((clock["step"] - clock["forwards"]) / clock["steps"] * 1e3)
        print(f"round {round_ + 1}: {rates[-1]:.0f} tokens/s, {clock['steps']} steps, {per_step[-1]:.2f} ms a step, "
              f"{outside[-1]:.2f} ms of it outside the forwards")
    print(f"medians: {statistics.median(rates):.0f} tokens/s, {statistics.median(per_step):.2f} ms a step, "
          f"{statistics.median(outside):.2f} ms outside the forwards")


if __name__ == "__main__":
    main()
