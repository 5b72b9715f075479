"""``auto`` with the draft's prompt charged (``_FEED_DECAY``: always deferred, and its feed charged to the
speculative arms while it is still to be paid) against the rule before (deferred only where ``ar`` leads at the
prefill, and never charged), in one process.

    python scripts/bench_auto_prompt_feed.py                          # bfloat16, T = 0.2
    python scripts/bench_auto_prompt_feed.py --dtype float32 --temperature 1.0

Rows ``ar``, ``auto`` and ``auto`` under the rule before (``AutoDecoder.prefill`` as it was, ``choose`` told of
no unfed prompt), 1 thread, bundled pair, GSM8K and HumanEval prompts, 128 new tokens (``--max-new-tokens``),
EOS off, ``--rounds`` passes over the prompts, the order of the rows alternating by prompt and round. Both
``auto`` rows share one policy (the rule changes no arm's record: the deferred prompt is fed outside every arm's
clock). Prints pooled tokens/s, the ratios, and in how many generations the draft was fed its prompt. docs/ENGINE.md, "The draft's
prompt, charged".
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from gbv.engine import auto, tree_decoder
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids

PREFILL, CHOOSE = auto.AutoDecoder.prefill, auto.AutoPolicy.choose


def prefill_before(self, prompt_ids) -> None:
    """``AutoDecoder.prefill`` before the change: the prompt deferred only where ``ar`` leads."""
    self.policy.flush()
    self.policy.close_stretch()
    self.policy.previous = None
    leader = self.policy.leader()
    self.base.defer_draft = (hasattr(self.base, "catch_up_draft") and leader is not None
                             and self.policy.arms[leader].method == "ar")
    self.prompt_len = len(prompt_ids)
    self.base.prefill(prompt_ids)


def choose_before(self, max_block=None, unfed_prompt=0, context=None):
    """``AutoPolicy.choose`` with no prompt to charge, as before the change."""
    return CHOOSE(self, max_block, 0, context)


def use(before: bool) -> None:
    auto.AutoDecoder.prefill = prefill_before if before else PREFILL
    auto.AutoPolicy.choose = choose_before if before else CHOOSE


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", help="the bundled pair's dtype (float32 or bfloat16)")
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--prompts", type=int, default=10, help="prompts per data set")
    parser.add_argument("--rounds", type=int, default=6, help="passes over the prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    settings = dict(temperature=args.temperature, eos_token_id=[], max_new_tokens=args.max_new_tokens)
    fed = collections.Counter()  # generations whose draft was fed its prompt, per row
    current = [None]
    feed, catch_up = tree_decoder.TreeDecoder._feed_prompt, tree_decoder.TreeDecoder.catch_up_draft

    def counted_feed(self, head):
        if self.draft is not None and not self.defer_draft and head:
            fed[current[0]] += 1
        feed(self, head)

    def counted_catch_up(self, upto):
        if self.draft is not None and self.draft_len == 0 and upto > 1:
            fed[current[0]] += 1
        catch_up(self, upto)

    tree_decoder.TreeDecoder._feed_prompt = counted_feed
    tree_decoder.TreeDecoder.catch_up_draft = counted_catch_up
    rows = ["ar", "auto", "auto, rule before"]
    for row in rows[:2]:  # (warm-up)
        generate(pair, prompt_ids=prompts[0], method=row, **{**settings, "max_new_tokens": 16})
    wall, tokens = collections.Counter(), collections.Counter()
    fed.clear()
    for round_ in range(args.rounds):
        for seed, prompt_ids in enumerate(prompts):
            for row in (rows if (seed + round_) % 2 == 0 else rows[::-1]):
                use(row.endswith("before"))
                current[0] = row
                start = time.perf_counter()
                out = generate(pair, prompt_ids=prompt_ids, method=row.split(",")[0], seed=seed, **settings)
                wall[row] += time.perf_counter() - start
                tokens[row] += out.stats.new_tokens
    use(False)
    generations = len(prompts) * args.rounds
    print(f"bundled pair, {args.dtype}, T = {args.temperature}, 1 thread, {generations} generations a row of "
          f"{args.max_new_tokens} tokens")
    print("\n| row | tokens/s | vs ar | generations whose draft was fed its prompt |\n|---|---:|---:|---:|")
    for row in rows:
        rate = tokens[row] / wall[row]
        print(f"| {row} | {rate:.0f} | {rate / (tokens['ar'] / wall['ar']):.3f}x | {fed[row]} |")
    ratio = (tokens["auto"] / wall["auto"]) / (tokens["auto, rule before"] / wall["auto, rule before"])
    print(f"\nauto / auto under the rule before: {ratio:.3f}x")


if __name__ == "__main__":
    main()
