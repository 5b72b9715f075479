"""How far ahead the AVX2 tiles of several rows prefetch their weights: forwards of the bundled models with
the compiled kernels built at several distances, in one process, alternating (1 thread).

    python scripts/bench_prefetch_distance.py                          # float32 target, factors one,1,2,4,8
    python scripts/bench_prefetch_distance.py --dtype bfloat16 --model draft --factors one,4

``gbv/engine/_host_kernels.c``'s ``AVX2_AHEAD`` sets a tile of R >= 2 rows by P panels to prefetch
2 R PREFETCH_BYTES / P bytes ahead in each panel's stream. Each factor F here builds the working tree's
file with F in place of that 2 (``one``: the distance of a one-row tile at every height, PREFETCH_BYTES / P,
as before the forty-sixth session); one-row tiles keep theirs in every build. Each row of the table: a
forward of n new tokens over a 150-token prefix (causal), or a tree of a root and 3 paths of 4 nodes,
medians over ``--rounds`` alternations of 5 calls each (after one untimed call; the order reversed
every other round); ratios against the first factor. The machine is
shared: only ratios within one run mean anything. On a CPU without AVX2 tiles in use (AVX-512) nothing
changes (the AVX-512 tiles have their own distance) unless ``GBV_HOST_AVX512=0`` switches them off.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench_kernels_ab import paths_mask
from gbv.engine import host_kernels
from gbv.engine.tree import prefix_then
from gbv.engine.tree_decoder import lean_model
from gbv.models.loading import load_pair
from kernels_at import kernels_from_source

SOURCE = Path(__file__).resolve().parent.parent / "gbv" / "engine" / "_host_kernels.c"
RULE = "2 * PREFETCH_BYTES * (R) / (P))"


def build(factor: str):
    """The working tree's kernels with the tiles of several rows prefetching ``factor`` R PREFETCH_BYTES / P
    ahead (``one``: PREFETCH_BYTES / P)."""
    source = SOURCE.read_text()
    if source.count(RULE) != 1:
        raise SystemExit(f"{SOURCE} no longer defines AVX2_AHEAD with {RULE!r}: update this script")
    distance = "PREFETCH_BYTES / (P))" if factor == "one" else f"{int(factor)} * PREFETCH_BYTES * (R) / (P))"
    return kernels_from_source(source.replace(RULE, distance), f"_host_kernels_ahead_{factor}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", choices=("target", "draft"), default="target")
    parser.add_argument("--factors", default="one,1,2,4,8", help="comma-separated: one, or whole numbers")
    parser.add_argument("--tokens", default="1,3,5,9,25", help="comma-separated pass sizes (and a tree of 13)")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    factors = args.factors.split(",")
    if host_kernels.host_kernels_unavailable() is not None:
        raise SystemExit(f"the compiled kernels do not run here: {host_kernels.host_kernels_unavailable()}")
    builds = {factor: build(factor) for factor in factors}
    installed = host_kernels._host_kernels
    lean = lean_model(getattr(load_pair("bundled", dtype=args.dtype), args.model))
    temporal = host_kernels.prefetch_temporal()  # (the hint chosen at load: every build takes it)
    prefix = 150
    avx512 = host_kernels.avx512_tiles()  # (GBV_HOST_AVX512=0: the AVX2 tiles on a CPU with AVX-512)
    print(f"{args.model}, {args.dtype}, medians over {args.rounds} rounds (ms); AVX-512 tiles: {avx512}\n")
    print("| tokens | " + " | ".join(factors) + " | " + " | ".join(f"{f} / {factors[0]}" for f in factors[1:]) + " |")
    print("|---:|" + "---:|" * (2 * len(factors) - 1))
    try:
        with torch.inference_mode():
            cache = lean.new_cache(1, prefix + 64)
            lean.forward(torch.arange(prefix)[None] % 100, torch.arange(prefix)[None], 0, cache, None, causal=True)
            cases = []
            for n in (int(value) for value in args.tokens.split(",")):
                mask = prefix_then(torch.tril(torch.ones(n, n, dtype=torch.bool)), prefix) if n > 1 else None
                cases.append((str(n), torch.full((1, n), 7), prefix + torch.arange(n)[None], mask))
            tree = paths_mask(3, 4)
            cases.append(("tree 13", torch.full((1, 13), 7), prefix + (tree.sum(dim=1) - 1)[None],
                          prefix_then(tree, prefix)))
            for label, tokens, positions, mask in cases:
                times: dict = {factor: [] for factor in factors}
                for round_ in range(args.rounds):
                    order = factors if round_ % 2 == 0 else factors[::-1]  # (no build always first)
                    for factor in order:
                        module = builds[factor]
                        host_kernels._host_kernels = module
                        module.set_avx512(avx512)
                        if temporal is not None:
                            module.set_prefetch_temporal(temporal)
                        lean.forward(tokens, positions, prefix, cache, mask)  # (its code back in the caches)
                        start = time.perf_counter()
                        for _ in range(5):
                            lean.forward(tokens, positions, prefix, cache, mask)
                        times[factor].append((time.perf_counter() - start) / 5)
                medians = {factor: statistics.median(values) for factor, values in times.items()}
                first = medians[factors[0]]
                print(f"| {label} | " + " | ".join(f"{medians[f] * 1e3:.3f}" for f in factors) + " | "
                      + " | ".join(f"{medians[f] / first:.3f}" for f in factors[1:]) + " |", flush=True)
    finally:
        host_kernels._host_kernels = installed


if __name__ == "__main__":
    main()
