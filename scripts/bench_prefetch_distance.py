"""How far ahead the AVX2 tiles of several rows prefetch their weights: forwards of the bundled models with
the compiled kernels built at several distances, in one process, alternating (1 thread).

    python scripts/bench_prefetch_distance.py                          # float32 target, factors one,1,2,4,8
    python scripts/bench_prefetch_distance.py --dtype bfloat16 --model draft --factors one,4
    python scripts/bench_prefetch_distance.py --tiles avx512 --factors one,1,2,4   # on a CPU with AVX-512

``gbv/engine/_host_kernels.c``'s ``AVX2_AHEAD`` sets a tile of R >= 2 rows by P panels to prefetch
2 R PREFETCH_BYTES / P bytes ahead in each panel's stream. Each factor F here builds the working tree's
file with F in place of that 2 (``one``: the distance of a one-row tile at every height, PREFETCH_BYTES / P,
as before the forty-sixth session); one-row tiles keep theirs in every build. Each row of the table: a
forward of n new tokens over a 150-token prefix (causal), or a tree of a root and 3 paths of 4 nodes,
medians over ``--rounds`` alternations of 5 calls each (after one untimed call; the order reversed
every other round); ratios against the first factor. The machine is
shared: only ratios within one run mean anything. On a CPU without AVX2 tiles in use (AVX-512) nothing
changes (the AVX-512 tiles have their own distance) unless ``GBV_HOST_AVX512=0`` switches them off.

``--tiles avx512`` varies the AVX-512 tiles' distance instead (``DEFINE_TILE512``: ``PREFETCH_BYTES / P`` below 8
rows, as AVX2's was, and ``PREFETCH_BYTES`` from 8): factor F sets tiles of 2-7 rows to F R PREFETCH_BYTES / P,
``one`` leaves them as they are. Not measured yet: no machine with AVX-512 since the forty-sixth session.
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
# the distance each kind of tile takes in the working tree, and what a factor F puts in its place
RULES = {
    "avx2": ("2 * PREFETCH_BYTES * (R) / (P))",
             lambda factor: "PREFETCH_BYTES / (P))" if factor == "one" else f"{factor} * PREFETCH_BYTES * (R) / (P))"),
    "avx512": ("R < 8 ? PREFETCH_BYTES / P : PREFETCH_BYTES);",
               lambda factor: "R < 8 ? PREFETCH_BYTES / P : PREFETCH_BYTES);" if factor == "one" else
               f"R == 1 ? PREFETCH_BYTES / P : R < 8 ? {factor} * PREFETCH_BYTES * R / P : PREFETCH_BYTES);"),
}


def build(tiles: str, factor: str):
    """The working tree's kernels with ``tiles``' tiles of several rows prefetching ``factor`` R PREFETCH_BYTES / P
    ahead (``one``: AVX2 tiles at PREFETCH_BYTES / P, AVX-512 ones as they are)."""
    source = SOURCE.read_text()
    rule, replace = RULES[tiles]
    if source.count(rule) != 1:
        raise SystemExit(f"{SOURCE} no longer has {rule!r} once for the {tiles} tiles: update this script")
    if factor != "one" and not factor.isdigit():
        raise SystemExit(f"--factors takes 'one' or whole numbers, not {factor!r}")
    return kernels_from_source(source.replace(rule, replace(factor)), f"_host_kernels_ahead_{tiles}_{factor}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", choices=("target", "draft"), default="target")
    parser.add_argument("--factors", default="one,1,2,4,8", help="comma-separated: one, or whole numbers")
    parser.add_argument("--tokens", default="1,3,5,9,25", help="comma-separated pass sizes (and a tree of 13)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--tiles", choices=tuple(RULES), default="avx2", help="whose distance to vary")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    factors = args.factors.split(",")
    if host_kernels.host_kernels_unavailable() is not None:
        raise SystemExit(f"the compiled kernels do not run here: {host_kernels.host_kernels_unavailable()}")
    if (args.tiles == "avx512") != host_kernels.avx512_tiles():
        raise SystemExit(f"the {args.tiles} tiles do not run here (AVX-512 tiles in use: {host_kernels.avx512_tiles()}; "
                         "GBV_HOST_AVX512=0 switches them off)")
    builds = {factor: build(args.tiles, factor) for factor in factors}
    installed = host_kernels._host_kernels
    lean = lean_model(getattr(load_pair("bundled", dtype=args.dtype), args.model))
    temporal = host_kernels.prefetch_temporal()  # (the hint chosen at load: every build takes it)
    prefix = 150
    avx512 = host_kernels.avx512_tiles()  # (GBV_HOST_AVX512=0: the AVX2 tiles on a CPU with AVX-512)
    print(f"{args.model}, {args.dtype}, {args.tiles} tiles' distance, medians over {args.rounds} rounds (ms)\n")
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
