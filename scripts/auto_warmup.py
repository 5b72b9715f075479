"""How long an arm's cost takes to settle after a switch: step times by position, in one run (1 thread,
bundled pair).

    python scripts/auto_warmup.py --dtype bfloat16                     # BV L = 2 and ar, 16 and 24 steps
    python scripts/auto_warmup.py --dtype float32 --block-len 4 --block-steps 8 --ar-steps 32

Each prompt (N GSM8K + N HumanEval, 128 new tokens, EOS off, T = 0.2) runs twice with the same seed:
as a fixed ``ar`` row, and as ``auto`` forced to alternate stretches of BV L and of ``ar``. A step's
position is how many steps of the same kind ran right before it (0 after the other kind or the
prompt's prefill). Prints the median milliseconds per step at each position, per row and kind: where
they settle is the arm's steady cost, and the excess before it is what a switch to the arm costs
(docs/ENGINE.md, "`auto`: `ar`'s warm-up").
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from gbv.engine import auto, tree_decoder
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=5, help="prompts per data set")
    parser.add_argument("--block-len", type=int, default=2)
    parser.add_argument("--block-steps", type=int, default=16, help="BV iterations per stretch")
    parser.add_argument("--ar-steps", type=int, default=24, help="ar steps per stretch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    times: dict[tuple[str, str, int], list[float]] = collections.defaultdict(list)
    state = {"row": "", "kind": None, "position": 0}
    step, plain_steps = tree_decoder.TreeDecoder.step, tree_decoder.TreeDecoder.plain_steps

    def note(kind: str, seconds: float) -> None:
        state["position"] = state["position"] + 1 if kind == state["kind"] else 0
        state["kind"] = kind
        times[(state["row"], kind, state["position"])].append(seconds)

    def timed(self, block_len=None):
        start = time.perf_counter()
        new = step(self, block_len)
        if not (block_len == 0 or self.method == "ar"):  # (ar's steps are timed in plain_steps)
            note(f"BV L={self.block_len}", time.perf_counter() - start)
        return new

    def one_at_a_time(self, limit):  # ar's plain steps, one call each (a run's steps have no times of their own)
        start = time.perf_counter()
        new = plain_steps(self, 1)
        note("ar", time.perf_counter() - start)
        return new

    arms = auto.default_arms(False, True)
    ar, block = arms.index(auto.Arm("ar", 0, 0)), arms.index(auto.Arm("block", 1, args.block_len))
    period, count = args.block_steps + args.ar_steps, [0]

    def forced(self, max_block=None, unfed_prompt=0, context=None):  # the alternation, in place of the policy's choice
        count[0] += 1
        self.last_leader = None
        fits = max_block is None or max_block >= args.block_len
        return block if count[0] % period < args.block_steps and fits else ar

    tree_decoder.TreeDecoder.step = timed
    tree_decoder.TreeDecoder.plain_steps = one_at_a_time
    auto.AutoPolicy.choose = forced
    auto._STRETCH = 1  # (the forced choice makes its own stretches, one choice a step)
    settings = dict(temperature=0.2, eos_token_id=[], block_len=args.block_len)
    for method in ("ar", "auto"):  # warm-up
        generate(pair, prompt_ids=prompts[0], method=method, max_new_tokens=16, **settings)
    times.clear()
    for seed, ids in enumerate(prompts):
        for method in (("ar", "auto") if seed % 2 == 0 else ("auto", "ar")):
            state.update(row="fixed ar" if method == "ar" else "alternating", kind=None)
            generate(pair, prompt_ids=ids, method=method, max_new_tokens=128, seed=seed, **settings)
    print(f"{args.dtype}, T = 0.2, {len(prompts)} prompts, stretches of {args.block_steps} BV L={args.block_len}"
          f" and {args.ar_steps} ar steps\n")
    print("| row | kind | position | steps | median ms |\n|---|---|---:|---:|---:|")
    for (row, kind, position), values in sorted(times.items()):
        if position < 12 or position % 4 == 0:
            print(f"| {row} | {kind} | {position} | {len(values)} | {statistics.median(values) * 1e3:.3f} |")


if __name__ == "__main__":
    main()
