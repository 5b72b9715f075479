"""A batch's lone row against one sequence: ``gbv.generate`` on each prompt alone, against the same
prompts run one at a time through ``BatchRows`` over a ``BatchTreeDecoder`` of 16 rows (what ``gbv
serve`` does at concurrency 1, and every batch's tail), alternating, in one process, bundled pair.

    python scripts/bench_lone_row.py --method block      # BV L = 4, greedy, 12 GSM8K prompts x 64 tokens
    python scripts/bench_lone_row.py --method auto --temperature 1.0

Prints each form's pooled tokens/s per round.
"""
from __future__ import annotations

import argparse
import time

import torch

import gbv
from gbv.data import load_prompts
from gbv.engine.batch import BatchTreeDecoder
from gbv.engine.generate import BatchRows, prepare_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="block", help="block (BV L = 4, one path) or auto")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled")
    prompts = load_prompts("gsm8k", args.prompts)
    settings = dict(method=args.method, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                    eos_token_id=[])
    if args.method == "block":
        settings.update(block_len=4, num_paths=1)

    def single() -> int:
        return sum(gbv.generate(pair, prompt=p, **settings).stats.new_tokens for p in prompts)

    rows = None

    def lone_row() -> int:
        nonlocal rows
        made = 0
        for prompt in prompts:
            job = prepare_job(pair, pair.tokenizer.encode(prompt), **settings)
            if rows is None:
                rows = BatchRows(pair, BatchTreeDecoder(pair.target, pair.draft, job.vocab, pair.device, 16))
            rows.add("lone", job, emit=False)
            while rows.active:
                for _, event, value in rows.step():
                    if event == "done":
                        made += value.stats.new_tokens
        return made

    for round_ in range(args.rounds):
        line = []
        for form in ((single, lone_row) if round_ % 2 == 0 else (lone_row, single)):
            began = time.perf_counter()
            made = form()
            line.append(f"{form.__name__} {made / (time.perf_counter() - began):.0f} tokens/s")
        print(f"round {round_ + 1}: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
