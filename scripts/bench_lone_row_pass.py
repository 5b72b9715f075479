"""A batch's only row (what ``gbv serve`` runs for one request at a time), its pass as one sequence's, against the
single decoder and the batch's general form, in one process.

    python scripts/bench_lone_row_pass.py                   # bfloat16, T = 1
    python scripts/bench_lone_row_pass.py --dtype float32 --temperature 0.2

Three forms of each row (``--rows``: ``ar``, BV L = 4 and ``auto``), alternating by prompt and round, 1 thread,
bundled pair, GSM8K and HumanEval prompts, 128 new tokens, EOS off: ``generate`` on the prompt alone (the single
decoder); the prompt as the only row of a :class:`~gbv.engine.generate.BatchRows` over a
:class:`~gbv.engine.batch.BatchTreeDecoder` of 4 rows, as ``gbv serve`` decodes it; and the same with
``BatchTreeDecoder._lone_row_pass`` switched off (the batch's general form for the target's pass, as before the
forty-eighth session). Pooled tokens/s of each and their ratios. ``ar`` and BV commit the same tokens in all
three forms (tests/engine/test_batch.py). docs/ENGINE.md, "A lone batch row's pass as one sequence's".
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from gbv.engine.batch import BatchTreeDecoder
from gbv.engine.generate import BatchRows, generate, prepare_job
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids

LONE_PASS = BatchTreeDecoder._lone_row_pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", help="the bundled pair's dtype (float32 or bfloat16)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rows", default="ar,block,auto", help="methods (block runs L = 4)")
    parser.add_argument("--prompts", type=int, default=5, help="prompts per data set")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the prompts")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    settings = dict(temperature=args.temperature, eos_token_id=[], max_new_tokens=128, block_len=4)
    rows = BatchRows(pair, BatchTreeDecoder(pair.target, pair.draft, prepare_job(pair, prompts[0]).vocab,
                                            pair.device, 4))

    def lone(ids, method, seed, lone_pass):
        BatchTreeDecoder._lone_row_pass = LONE_PASS if lone_pass else (lambda self, *a: None)
        rows.add(0, prepare_job(pair, ids, method=method, seed=seed, **settings), emit=False)
        out = None
        while rows.active:
            for _, event, value in rows.step():
                if event == "done":
                    out = value
        BatchTreeDecoder._lone_row_pass = LONE_PASS
        return out

    forms = ["single", "lone row", "lone row, general form"]

    def run(method, ids, seed, form):
        if form == "single":
            return generate(pair, prompt_ids=ids, method=method, seed=seed, **settings)
        return lone(ids, method, seed, form == "lone row")

    methods = args.rows.split(",")
    for method in methods:  # (warm-up)
        for form in forms:
            run(method, prompts[0], 0, form)
    wall, tokens = collections.Counter(), collections.Counter()
    for round_ in range(args.rounds):
        for seed, ids in enumerate(prompts):
            for method in methods:
                for form in (forms if (seed + round_) % 2 == 0 else forms[::-1]):
                    start = time.perf_counter()
                    out = run(method, ids, seed, form)
                    wall[(method, form)] += time.perf_counter() - start
                    tokens[(method, form)] += out.stats.new_tokens
    print(f"bundled pair, {args.dtype}, T = {args.temperature}, 1 thread, "
          f"{len(prompts) * args.rounds} generations a form")
    print("\n| row | single, tokens/s | lone row | lone row, general form | lone / single | lone / general |")
    print("|---|---:|---:|---:|---:|---:|")
    for method in methods:
        rate = {form: tokens[(method, form)] / wall[(method, form)] for form in forms}
        print(f"| {method if method != 'block' else 'block L=4'} | {rate['single']:.0f} | {rate['lone row']:.0f} | "
              f"{rate['lone row, general form']:.0f} | {rate['lone row'] / rate['single']:.3f} | "
              f"{rate['lone row'] / rate['lone row, general form']:.3f} |")


if __name__ == "__main__":
    main()
