"""Values prefetched in long batch steps (``host_kernels.KV_PREFETCH_MIN_BYTES``): batched generation
with the prefetches forced on against forced off, in one process, bundled pair, 1 thread.

    python scripts/bench_kv_prefetch.py                                  # 16 rows, prompts of 300 tokens
    python scripts/bench_kv_prefetch.py --batch 4 --prompt-tokens 300 --dtype bfloat16
    python scripts/bench_kv_prefetch.py --rows ar,block:4 --rounds 5 --max-new-tokens 256

Each prompt is GSM8K questions joined until it holds ``--prompt-tokens`` tokens (each row starts at
another question). Every round runs every row with the threshold at 0 (every batch step prefetches
each head's values as it scores its keys) and at 2**62 (none does), in alternating order; the tokens
are the same bits either way (tests/engine/test_host_kernels.py). Reported per row: the median wall
time of the whole ``generate`` call (prefills included: they never prefetch) in each form, their
ratio, and the step's bytes of keys and values at the first and the last step against the default
threshold, so one sees which form the default takes.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import gbv
import gbv.engine.host_kernels as host_kernels
from gbv.data import load_prompts

from bench_rev_ab import parse_row  # scripts/ is on the path when run as a script


def long_prompts(pair, count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` token ids: GSM8K questions joined, row i starting at question i."""
    questions = [pair.tokenizer(text)["input_ids"] for text in load_prompts("gsm8k", 64)]
    prompts = []
    for i in range(count):
        ids, j = [], i
        while len(ids) < tokens:
            ids += questions[j % len(questions)]
            j += 1
        prompts.append(ids[:tokens])
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rows", default="ar,block:2,block:4")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", dtype=getattr(torch, args.dtype))
    prompts = long_prompts(pair, args.batch, args.prompt_tokens)
    config = pair.target.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    item = 2 if args.dtype == "bfloat16" else 4  # (the cache holds the model's dtype)

    def step_bytes(slots: int) -> int:  # as lean_host reckons a batch step's keys and values
        return host_kernels.kv_step_bytes(config.num_hidden_layers, args.batch, config.num_key_value_heads, slots,
                                          head_dim, item)

    default = host_kernels.KV_PREFETCH_MIN_BYTES
    first, last = step_bytes(args.prompt_tokens + 1), step_bytes(args.prompt_tokens + args.max_new_tokens)
    print(f"bundled pair, {args.dtype}, {args.batch} rows, prompts of {args.prompt_tokens} tokens, "
          f"{args.max_new_tokens} new tokens, T = {args.temperature}, 1 thread, {args.rounds} rounds; keys and "
          f"values a step {first / 2**20:.0f}-{last / 2**20:.0f} MiB against the default threshold "
          f"{default / 2**20:.0f} MiB")
    forms = {"on": 0, "off": 2 ** 62}
    times: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        for label in args.rows.split(","):
            settings = parse_row(label)
            order = list(forms) if round_ % 2 == 0 else list(forms)[::-1]
            outputs = {}
            for form in order:
                host_kernels.KV_PREFETCH_MIN_BYTES = forms[form]
                start = time.perf_counter()
                outputs[form] = gbv.generate(pair, prompt_ids=prompts, batch_size=args.batch,
                                             max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                             eos_token_id=[], seed=round_, **settings)
                times.setdefault((label, form), []).append(time.perf_counter() - start)
            host_kernels.KV_PREFETCH_MIN_BYTES = default
            if [o.token_ids for o in outputs["on"]] != [o.token_ids for o in outputs["off"]]:
                raise SystemExit(f"{label}: the tokens differ with and without the prefetches")
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print("| row | prefetch on, s | off, s | on / off |")
    print("|---|---:|---:|---:|")
    for label in args.rows.split(","):
        on, off = (statistics.median(times[(label, form)]) for form in forms)
        print(f"| {label} | {on:.3f} | {off:.3f} | {on / off:.3f} |")


if __name__ == "__main__":
    main()
