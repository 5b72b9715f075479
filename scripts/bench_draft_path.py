"""A drafted path in one compiled call (``LeanCausalLM.sampled_path``) against a call per step, in one process.

    python scripts/bench_draft_path.py                       # bfloat16, T = 1
    python scripts/bench_draft_path.py --dtype float32 --rows block:2,block:4,block:8

Two parts, each alternating the two forms (the one call switched off by making ``sampled_path`` decline, as it
does where it cannot run), 1 thread, bundled pair:

1. the draft alone: a path of L tokens drafted after a 150-token prefix, back to back (``--lengths``), medians
   of 400 alternating pairs;
2. whole generations (``--rows``, GSM8K and HumanEval prompts, 128 new tokens, EOS off, ``--rounds`` passes over
   the prompts, the order of the two forms alternating by prompt and round): pooled tokens/s of each form and
   their ratio. Both forms draw the same tokens (tests/engine/test_lean_host.py), so the ratio is time alone.

docs/ENGINE.md, "A drafted path in one compiled call".
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gbv.engine.generate import generate, shared_vocab
from gbv.engine.lean import LeanCausalLM
from gbv.engine.sampling import SamplingConfig
from gbv.engine.tree_decoder import draft_lean_model, draft_one_path
from gbv.models.loading import load_pair
from gbv.verify.common import TorchRandom
from prompt_sets import benchmark_prompt_ids

ONE_CALL = LeanCausalLM.sampled_path


def use_one_call(on: bool) -> None:
    """The one-call path, or a call per step (``sampled_path`` declining, as where it cannot run)."""
    LeanCausalLM.sampled_path = ONE_CALL if on else (lambda self, *args, **kwargs: None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", help="the bundled pair's dtype (float32 or bfloat16)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lengths", default="2,4,8", help="path lengths of part 1")
    parser.add_argument("--rows", default="block:2,block:4,block:8,token:4", help="METHOD:L rows of part 2")
    parser.add_argument("--prompts", type=int, default=10, help="prompts per data set in part 2")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the prompts in part 2")
    args = parser.parse_args(argv)
    lengths = [int(value) for value in args.lengths.split(",")]
    rows = [(row.split(":")[0], int(row.split(":")[1])) for row in args.rows.split(",")]
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    vocab = shared_vocab(pair.target, pair.draft, pair.tokenizer)  # (what the engine drafts over)
    draft = draft_lean_model(pair.draft, pair.target)
    config = SamplingConfig(args.temperature)
    print(f"bundled pair, {args.dtype}, T = {args.temperature}, 1 thread")
    print("\n| draft path | one call, ms | a call per step, ms | ratio |\n|---:|---:|---:|---:|")
    prefix = 150
    for length in lengths:
        cache = draft.new_cache(1, prefix + 2 * length + 8)
        with torch.inference_mode():
            draft.forward(torch.arange(prefix)[None] % 100, torch.arange(prefix)[None], 0, cache, None, causal=True)
        rng, probs, tokens = TorchRandom(seed=0), np.zeros((length, vocab), np.float32), list(range(prefix + 1))
        times = {True: [], False: []}
        for r in range(400):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                use_one_call(on)
                start = time.perf_counter()
                draft_one_path(draft, cache, tokens, prefix, length, vocab, config, rng, probs)
                times[on].append(time.perf_counter() - start)
        one, each = statistics.median(times[True]), statistics.median(times[False])
        print(f"| L = {length} | {one * 1e3:.3f} | {each * 1e3:.3f} | {one / each:.3f} |")
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    settings = dict(temperature=args.temperature, eos_token_id=[])
    for method, length in rows:  # (warm-up)
        generate(pair, prompt_ids=prompts[0], method=method, block_len=length, max_new_tokens=16, **settings)
    pooled = {(row, on): [0.0, 0] for row in rows for on in (True, False)}
    for round_ in range(args.rounds):
        for seed, prompt_ids in enumerate(prompts):
            for row in rows:
                for on in ((True, False) if (seed + round_) % 2 == 0 else (False, True)):
                    use_one_call(on)
                    start = time.perf_counter()
                    out = generate(pair, prompt_ids=prompt_ids, method=row[0], block_len=row[1], max_new_tokens=128,
                                   seed=seed, **settings)
                    pooled[(row, on)][0] += time.perf_counter() - start
                    pooled[(row, on)][1] += out.stats.new_tokens
    use_one_call(True)
    print(f"\n| row ({len(prompts)} prompts x {args.rounds}) | one call, tokens/s | a call per step, tokens/s | ratio |")
    print("|---|---:|---:|---:|")
    for row in rows:
        one = pooled[(row, True)][1] / pooled[(row, True)][0]
        each = pooled[(row, False)][1] / pooled[(row, False)][0]
        print(f"| {row[0]} L = {row[1]} | {one:.0f} | {each:.0f} | {one / each:.3f} |")


if __name__ == "__main__":
    main()
