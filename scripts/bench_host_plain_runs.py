"""ar's plain steps in runs of one compiled call (``LeanCausalLM.sampled_run`` on the host) against a call per
step, in one process.

    python scripts/bench_host_plain_runs.py                     # bfloat16, T = 1
    python scripts/bench_host_plain_runs.py --dtype float32 --temperature 0.2

The two forms alternate (a call per step is ``GBV_PLAIN_RUN = 1``'s form: ``static_sampling.PLAIN_RUN`` set to 1
in this process), 1 thread, bundled pair:

1. the steps alone: runs of 2, 4 and 8 plain steps of the target after a 150-token prompt (``--lengths``),
   medians of 300 alternating pairs, time per step;
2. whole generations (``--rows``: ``ar`` and ``auto``; GSM8K and HumanEval prompts, 128 new tokens, EOS off
   unless ``--eos``, ``--rounds`` passes over the prompts, the order of the two forms alternating by prompt
   and round): pooled tokens/s of each form and their ratio. ``ar`` draws the same tokens in both forms
   (tests/engine/test_lean_host.py), so its ratio is time alone; ``auto``'s choices follow its clocks, so its
   ratio also holds the policy's own noise.

docs/ENGINE.md, "ar's steps in runs on the CPU".
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gbv.engine import static_sampling
from gbv.engine.generate import generate, shared_vocab
from gbv.engine.lean import LeanCausalLM
from gbv.engine.sampling import SamplingConfig
from gbv.models.loading import load_pair
from gbv.verify.common import TorchRandom
from prompt_sets import benchmark_prompt_ids

RUN = static_sampling.PLAIN_RUN


def use_runs(on: bool) -> None:
    """Runs of up to ``GBV_PLAIN_RUN`` steps (8 unless set), or a call per step."""
    static_sampling.PLAIN_RUN = RUN if on else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", help="the bundled pair's dtype (float32 or bfloat16)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lengths", default="2,4,8", help="run lengths of part 1")
    parser.add_argument("--rows", default="ar,auto", help="methods of part 2")
    parser.add_argument("--prompts", type=int, default=10, help="prompts per data set in part 2")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the prompts in part 2")
    parser.add_argument("--eos", action="store_true", help="stop at the tokenizer's EOS in part 2 (default: off)")
    args = parser.parse_args(argv)
    lengths = [int(value) for value in args.lengths.split(",")]
    rows = args.rows.split(",")
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    vocab = shared_vocab(pair.target, pair.draft, pair.tokenizer)
    target = LeanCausalLM(pair.target)
    config = SamplingConfig(args.temperature)
    print(f"bundled pair, {args.dtype}, T = {args.temperature}, 1 thread, runs of up to {RUN}")
    print("\n| plain steps | one call, ms a step | a call per step, ms a step | ratio |\n|---:|---:|---:|---:|")
    prefix = 150
    for length in lengths:
        cache = target.new_cache(1, prefix + length + 8)
        with torch.inference_mode():
            target.forward(torch.arange(prefix)[None] % 100, torch.arange(prefix)[None], 0, cache, None, causal=True)
        rng = TorchRandom(seed=0)
        times = {True: [], False: []}
        for r in range(300):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                start = time.perf_counter()
                if on:
                    target.sampled_run(7, prefix, length, cache, vocab, config, rng)
                else:
                    token = 7
                    for s in range(length):
                        token = target.sampled_chain([token], prefix + s, cache, vocab, config, rng)
                times[on].append((time.perf_counter() - start) / length)
        one, each = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {length} | {one * 1e3:.3f} | {each * 1e3:.3f} | {one / each:.3f} |")
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    settings = dict(temperature=args.temperature, **({} if args.eos else dict(eos_token_id=[])))
    for method in rows:  # (warm-up)
        generate(pair, prompt_ids=prompts[0], method=method, max_new_tokens=16, **settings)
    pooled = {(row, on): [0.0, 0, 0] for row in rows for on in (True, False)}
    for round_ in range(args.rounds):
        for seed, prompt_ids in enumerate(prompts):
            for row in rows:
                for on in ((True, False) if (seed + round_) % 2 == 0 else (False, True)):
                    use_runs(on)
                    start = time.perf_counter()
                    out = generate(pair, prompt_ids=prompt_ids, method=row, max_new_tokens=128, seed=seed, **settings)
                    pooled[(row, on)][0] += time.perf_counter() - start
                    pooled[(row, on)][1] += out.stats.new_tokens
                    pooled[(row, on)][2] += out.stats.to_dict()["target_calls"]
    use_runs(True)
    eos = "EOS on" if args.eos else "EOS off"
    print(f"\n| row ({len(prompts)} prompts x {args.rounds}, {eos}) | runs, tokens/s | a call per step, tokens/s "
          "| ratio | target calls, runs / a call per step |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        one = pooled[(row, True)][1] / pooled[(row, True)][0]
        each = pooled[(row, False)][1] / pooled[(row, False)][0]
        print(f"| {row} | {one:.0f} | {each:.0f} | {one / each:.3f} | {pooled[(row, True)][2]} / "
              f"{pooled[(row, False)][2]} |")


if __name__ == "__main__":
    main()
