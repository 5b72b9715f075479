#!/usr/bin/env python3
"""Before/after in one run (1 thread, bundled pair): the verifiers' host forms with the compiled helpers
of gbv/verify/_verify_kernels.c (gbv-adaptive's node-weight search, bucket masses, the exact ranks among
a few tokens, TorchRandom.sample's draw) against the numpy code, switched per prompt, interleaved.

    python scripts/bench_verify_kernels_ab.py                     # bf16, 10 GSM8K + 10 HumanEval prompts
    python scripts/bench_verify_kernels_ab.py --dtype float32 --prompts 5
    python scripts/bench_verify_kernels_ab.py --compare simd       # the helpers' AVX2 loops against scalar ones

Prints, per (temperature, row): tokens/s with and without the kernels (pooled over the prompts), their
ratio, the verifier's share of the wall time either way, the share of the forwards (draft and target
phases, as scripts/bench_engine.py), and on how many prompts the two made the same tokens (the helpers
give the numpy code's bits, or its weights to rounding, so the same seeds should make the same tokens).
:func:`interleaved_ab` is the loop, shared with scripts/bench_tree_host_ab.py.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

import gbv
from gbv.verify import common
from prompt_sets import benchmark_prompts

ROWS = [("block", 1, 4), ("gbv-adaptive", 3, 4), ("gbv-adaptive", 3, 8), ("gbv", 3, 8)]


def interleaved_ab(dtype: str, prompts: int, max_new_tokens: int, rows: list[tuple[str, int, int]],
                   use: Callable[[bool], None]) -> tuple[str, dict, dict]:
    """Every row on every prompt with variant False ("before") and True ("after"), in alternating order
    per prompt, with the same seed; ``use(variant)`` switches the engine to a variant. Returns a header
    line, ``sums[(temperature, row, variant)]`` = pooled ``[tokens, seconds, verify s, draft + target s,
    other s]`` and ``same[(temperature, row)]`` = prompts on which both variants made the same tokens."""
    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", dtype=dtype)
    texts = benchmark_prompts(prompts)
    gbv.generate(pair, prompt=texts[0], method="gbv", num_paths=3, block_len=4, max_new_tokens=16,
                 eos_token_id=[])  # warm-up
    sums: dict = {}
    same: dict = {}
    for temperature in (0.2, 1.0):
        for index, prompt in enumerate(texts):
            for row in rows:
                method, num_paths, block_len = row
                tokens = {}
                for variant in ((False, True) if index % 2 == 0 else (True, False)):
                    use(variant)
                    out = gbv.generate(pair, prompt=prompt, method=method, num_paths=num_paths, block_len=block_len,
                                       temperature=temperature, max_new_tokens=max_new_tokens, eos_token_id=[],
                                       seed=index)
                    s = out.stats
                    total = sums.setdefault((temperature, row, variant), [0, 0.0, 0.0, 0.0, 0.0])
                    total[0] += s.new_tokens
                    total[1] += s.time_total
                    total[2] += s.time_verify
                    total[3] += s.time_draft + s.time_target  # (the prefill's forwards are in these)
                    total[4] += s.time_other
                    tokens[variant] = list(out.token_ids)
                same[(temperature, row)] = same.get((temperature, row), 0) + (tokens[False] == tokens[True])
    use(True)
    return f"{dtype}, {len(texts)} prompts, {max_new_tokens} tokens, 1 thread", sums, same


def label(row: tuple[str, int, int]) -> str:
    return f"{row[0]} K={row[1]} L={row[2]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=10, help="GSM8K and as many HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--compare", default="numpy", choices=["numpy", "simd"],
                        help="numpy: the compiled helpers against the numpy code (default); simd: the helpers' "
                             "AVX2 loops (masked sums, gbv-adaptive's node keys and cut) against their scalar "
                             "loops, the same bits")
    args = parser.parse_args()
    kernels = common.compiled_kernels
    if kernels is None:
        raise SystemExit("gbv.verify._verify_kernels is not built: reinstall gbv with a C compiler")

    def use(compiled: bool) -> None:
        if args.compare == "simd":
            kernels.set_simd(compiled)
        else:
            common.compiled_kernels = kernels if compiled else None

    header, sums, same = interleaved_ab(args.dtype, args.prompts, args.max_new_tokens, ROWS, use)
    print(header + "\n")
    print_ab_table(sums, same, ROWS, args.prompts, ("numpy", "compiled") if args.compare == "numpy" else
                   ("scalar", "AVX2"), [("verify share", 2, ".0%"), ("forwards share", 3, ".0%")])
    return 0


def print_ab_table(sums: dict, same: dict, rows: list[tuple[str, int, int]], prompts: int, sides: tuple[str, str],
                   shares: list[tuple[str, int, str]]) -> None:
    """The markdown table of an :func:`interleaved_ab` run: per (temperature, row) the tokens/s of the
    two variants (named by ``sides``), their ratio, each share of the wall time in ``shares`` (title,
    index into the pooled sums, format) for both, and on how many prompts both made the same tokens."""
    before, after = sides
    print(f"| T | row | tokens/s {before} | tokens/s {after} | ratio | "
          + "".join(f"{title} {before} / {after} | " for title, _, _ in shares) + "same tokens |")
    print("|" + "---|" * (6 + len(shares)))
    for temperature in (0.2, 1.0):
        for row in rows:
            off, on = sums[(temperature, row, False)], sums[(temperature, row, True)]
            rate_off, rate_on = off[0] / off[1], on[0] / on[1]
            cells = "".join(f"{off[index] / off[1]:{fmt}} / {on[index] / on[1]:{fmt}} | " for _, index, fmt in shares)
            print(f"| {temperature} | {label(row)} | {rate_off:.1f} | {rate_on:.1f} | {rate_on / rate_off:.3f}x | "
                  f"{cells}{same[(temperature, row)]}/{2 * prompts} |")


if __name__ == "__main__":
    raise SystemExit(main())
