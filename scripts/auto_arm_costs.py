"""What ``method="auto"`` spends per arm, against ``ar``, in one run.

    python scripts/auto_arm_costs.py --dtype bfloat16 --temperature 1.0 --prompts 5

Runs ``ar`` and ``auto`` over the same prompts (``--prompts`` GSM8K + as many HumanEval, 128 new
tokens, EOS off, 1 thread, one fresh policy), ``--passes`` times in turn: the first pass of ``auto``
learns (it explores), later ones run with the policy learnt. Prints each pass's tokens/s and the
phase times from the stats, then, for the first pass of ``auto``, every arm's iterations, tokens and
seconds as its clock saw them (``AutoPolicy.record``), and what each arm lost against ``ar``'s own
rate inside ``auto`` (seconds - tokens / ar rate). The machine is shared: compare within one run.
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from gbv.engine import auto
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=5, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    arms = collections.defaultdict(lambda: [0, 0, 0.0])  # label -> iterations, tokens, seconds
    recording = [True]
    record = auto.AutoPolicy._record  # (every record goes through it, deferred or not)

    def counted(self, index, tokens, seconds, *rest):
        if recording[0]:
            entry = arms[self.arms[index].label]
            entry[0] += 1
            entry[1] += tokens
            entry[2] += seconds
        return record(self, index, tokens, seconds, *rest)

    auto.AutoPolicy._record = counted
    generate(pair, prompt_ids=prompts[0], method="ar", max_new_tokens=16, eos_token_id=[])  # warm-up
    print(f"{args.dtype}, T = {args.temperature}, {len(prompts)} prompts, {args.max_new_tokens} tokens each\n")
    print("| pass | method | tokens/s | auto / ar | prefill s | draft s | target s | verify s | other s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for number in range(1, args.passes + 1):
        rates = {}
        for method in ("ar", "auto"):
            recording[0] = number == 1
            phases = collections.Counter()
            made, start = 0, time.perf_counter()
            for seed, ids in enumerate(prompts):
                out = generate(pair, prompt_ids=ids, method=method, temperature=args.temperature,
                               max_new_tokens=args.max_new_tokens, eos_token_id=[], seed=seed)
                made += len(out.token_ids)
                stats = out.stats.to_dict()
                for phase in ("prefill", "draft", "target", "verify", "other"):
                    phases[phase] += stats.get(f"time_{phase}") or 0.0
            rates[method] = made / (time.perf_counter() - start)
            ratio = f"{rates['auto'] / rates['ar']:.3f}x" if method == "auto" else "-"
            print(f"| {number} | {method} | {rates[method]:.1f} | {ratio} | " + " | ".join(
                f"{phases[p]:.3f}" for p in ("prefill", "draft", "target", "verify", "other")) + " |")
    ar_iterations, ar_tokens, ar_seconds = arms.get("ar", (0, 0, 0.0))
    print("\nArms inside `auto`, first pass (its clock: the draft's catch-up is not an arm's)\n")
    print("| arm | iterations | tokens | seconds | tokens/s | lost against ar, ms |")
    print("|---|---:|---:|---:|---:|---:|")
    lost_total = 0.0
    for label, (iterations, tokens, seconds) in sorted(arms.items(), key=lambda item: -item[1][2]):
        lost = seconds - tokens * ar_seconds / ar_tokens if ar_tokens else float("nan")
        lost_total += lost
        print(f"| {label} | {iterations} | {tokens} | {seconds:.3f} | {tokens / seconds:.1f} | {lost * 1e3:.1f} |")
    print(f"\nLost in all: {lost_total * 1e3:.0f} ms of {sum(a[2] for a in arms.values()) * 1e3:.0f} ms in arms.")


if __name__ == "__main__":
    main()
