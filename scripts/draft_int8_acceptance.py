"""BV's block efficiency on the bundled pair with the draft's matrices rounded to bfloat16 values (what the
engine drafts with on the CPU) against int8 values with a scale per output column (round(w / s) s, s = max |w| /
127): whether int8 draft weights would cost acceptance. The rounding is done in place on the float32 draft,
which then drafts as it is (``GBV_DRAFT_BF16=0``). 40 prompts, 128 tokens, EOS off, 1 thread.

    python scripts/draft_int8_acceptance.py --temperature 1.0
    python scripts/draft_int8_acceptance.py --temperature 0.2

docs/ENGINE.md, "A drafted path in one compiled call", "Tried and not kept" (with scripts/draft_int8_rate.c).
"""
from __future__ import annotations

import argparse
import os

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--block-len", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=20, help="prompts per data set (GSM8K, HumanEval)")
    args = parser.parse_args(argv)
    os.environ["GBV_DRAFT_BF16"] = "0"  # (before the engine reads it: the draft drafts with its own weights)
    from prompt_sets import benchmark_prompt_ids
    from gbv.engine.generate import generate
    from gbv.models.loading import load_pair

    torch.set_num_threads(1)
    print(f"| draft weights | BV L = {args.block_len}, T = {args.temperature}: tokens per target call |\n|---|---:|")
    for rounding in ("bfloat16", "int8"):
        pair = load_pair("bundled", dtype="float32")
        with torch.no_grad():
            for parameter in pair.draft.parameters():
                if parameter.dim() != 2:
                    continue
                w = parameter.data  # (out, in): a scale per output column of the product
                if rounding == "bfloat16":
                    parameter.data = w.to(torch.bfloat16).float()
                else:
                    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127
                    parameter.data = torch.round(w / scale).clamp(-127, 127) * scale
        prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
        tokens = calls = 0
        for seed, prompt_ids in enumerate(prompts):
            out = generate(pair, prompt_ids=prompt_ids, method="block", block_len=args.block_len, max_new_tokens=128,
                           seed=seed, temperature=args.temperature, eos_token_id=[])
            tokens += out.stats.new_tokens
            calls += out.stats.target_calls
        print(f"| {rounding} | {tokens / calls:.3f} |")


if __name__ == "__main__":
    main()
