"""How far ahead the AVX2 tiles of several rows prefetch their weights: forwards of the bundled models with
the compiled kernels built at several distances, in one process, alternating (1 thread).

    python scripts/bench_prefetch_distance.py                          # float32 target, factors one,2/16,1,4,8/16
    python scripts/bench_prefetch_distance.py --dtype bfloat16 --factors 2/2,2/8,2/16 --after-draft
    python scripts/bench_prefetch_distance.py --dtype bfloat16 --model draft --factors one,4
    python scripts/bench_prefetch_distance.py --tiles avx512 --factors one,1,2,4   # on a CPU with AVX-512

``gbv/engine/_host_kernels.c``'s ``AVX2_AHEAD`` sets a tile of R >= 2 rows by P panels to prefetch
F R PREFETCH_BYTES / P bytes ahead in each panel's stream: F = ``AHEAD_ONE_PANEL`` (2) for one-panel tiles (4-6
rows, and the panels left over), ``AHEAD_PANELS`` (16) for the two-panel tiles of 2 and 3 rows. Each factor here
builds the working tree's file with other values: ``F/G`` sets the two, ``F`` both, ``one`` the distance of a
one-row tile at every height (PREFETCH_BYTES / P, as before the forty-sixth session); one-row tiles keep theirs in
every build. Each row of the table: a forward of n new tokens over a 150-token prefix (causal), or a tree of a
root and 3 paths of 4 nodes, medians over ``--rounds`` alternations of 5 calls each (after one untimed call; the
order reversed every other round); ratios against the first factor. ``--after-draft``: 4 one-token steps of the
draft before each timed forward of the target (not timed), as decoding alternates them, so that the target's
weights are where the draft's left them. The machine is shared: only ratios within one run mean anything. On a
CPU with the AVX-512 tiles in use nothing changes (they have their own distance) unless ``GBV_HOST_AVX512=0``
switches them off.

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
AVX2_DEFINES = ("#define AHEAD_ONE_PANEL 2 ", "#define AHEAD_PANELS 16 ")
AVX2_ONE_ROW = "((R) == 1 ? PREFETCH_BYTES / (P) :"  # (the macro's test: 'one' makes it true for every tile)
AVX512_RULE = "R < 8 ? PREFETCH_BYTES / P : PREFETCH_BYTES);"


def variant(source: str, tiles: str, factor: str) -> str:
    """``source`` with ``tiles``' distance set by ``factor``: ``one`` (AVX2: every tile at the one-row
    distance, PREFETCH_BYTES / P; AVX-512: as it is), ``F`` (tiles of several rows F R PREFETCH_BYTES / P) or,
    for AVX2, ``F/G`` (one-panel tiles F, two-panel tiles G)."""
    if tiles == "avx512":
        if source.count(AVX512_RULE) != 1:
            raise SystemExit(f"{SOURCE} no longer has {AVX512_RULE!r} once: update this script")
        if factor == "one":
            return source
        if not factor.isdigit():
            raise SystemExit(f"--factors for the AVX-512 tiles: 'one' or whole numbers, not {factor!r}")
        return source.replace(AVX512_RULE, f"R == 1 ? PREFETCH_BYTES / P : R < 8 ? {factor} * PREFETCH_BYTES * R / P : "
                                           "PREFETCH_BYTES);")
    if any(source.count(text) != 1 for text in (*AVX2_DEFINES, AVX2_ONE_ROW)):
        raise SystemExit(f"{SOURCE} no longer defines AHEAD_ONE_PANEL, AHEAD_PANELS and AVX2_AHEAD as this script "
                         "expects: update it")
    if factor == "one":
        return source.replace(AVX2_ONE_ROW, "(1 ? PREFETCH_BYTES / (P) :")
    one_panel, _, panels = factor.partition("/")
    panels = panels or one_panel
    if not (one_panel.isdigit() and panels.isdigit()):
        raise SystemExit(f"--factors takes 'one', whole numbers or pairs F/G, not {factor!r}")
    return source.replace(AVX2_DEFINES[0], f"#define AHEAD_ONE_PANEL {one_panel} ").replace(
        AVX2_DEFINES[1], f"#define AHEAD_PANELS {panels} ")


def build(tiles: str, factor: str):
    """The working tree's kernels with ``tiles``' distance set by ``factor`` (:func:`variant`)."""
    name = f"_host_kernels_ahead_{tiles}_{factor.replace('/', '_')}"
    return kernels_from_source(variant(SOURCE.read_text(), tiles, factor), name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", choices=("target", "draft"), default="target")
    parser.add_argument("--factors", default="one,2/16,1,4,8/16",
                        help="comma-separated: one, F (every tile of several rows) or F/G (AVX2: one-panel F, two-panel G)")
    parser.add_argument("--tokens", default="1,3,5,9,25", help="comma-separated pass sizes (and a tree of 13)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--tiles", choices=("avx2", "avx512"), default="avx2", help="whose distance to vary")
    parser.add_argument("--after-draft", action="store_true", help="4 draft steps before each target forward")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    factors = args.factors.split(",")
    if host_kernels.host_kernels_unavailable() is not None:
        raise SystemExit(f"the compiled kernels do not run here: {host_kernels.host_kernels_unavailable()}")
    avx512 = host_kernels.avx512_tiles()  # (GBV_HOST_AVX512=0: the AVX2 tiles on a CPU with AVX-512)
    if (args.tiles == "avx512") != avx512:
        raise SystemExit(f"the {args.tiles} tiles do not run here (AVX-512 tiles in use: {avx512}; "
                         "GBV_HOST_AVX512=0 switches them off)")
    if args.after_draft and args.model == "draft":
        raise SystemExit("--after-draft times the target: leave --model as it is")
    builds = {factor: build(args.tiles, factor) for factor in factors}
    installed = host_kernels._host_kernels
    pair = load_pair("bundled", dtype=args.dtype)
    lean, draft = lean_model(getattr(pair, args.model)), lean_model(pair.draft)
    temporal = host_kernels.prefetch_temporal()  # (the hint chosen at load: every build takes it)
    prefix = 150
    print(f"{args.model}, {args.dtype}, {args.tiles} tiles' distance, medians over {args.rounds} rounds (ms)"
          + (", after 4 draft steps each" if args.after_draft else "") + "\n")
    print("| tokens | " + " | ".join(factors) + " | " + " | ".join(f"{f} / {factors[0]}" for f in factors[1:]) + " |")
    print("|---:|" + "---:|" * (2 * len(factors) - 1))
    try:
        with torch.inference_mode():
            cache, draft_cache = lean.new_cache(1, prefix + 64), draft.new_cache(1, prefix + 64)
            for model, model_cache in ((lean, cache), (draft, draft_cache)):
                model.forward(torch.arange(prefix)[None] % 100, torch.arange(prefix)[None], 0, model_cache, None,
                              causal=True)
            one, at = torch.tensor([[7]]), torch.tensor([[prefix]])
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
                        seconds = 0.0
                        for _ in range(5):
                            if args.after_draft:
                                for _ in range(4):
                                    draft.forward(one, at, prefix, draft_cache, None)
                            start = time.perf_counter()
                            lean.forward(tokens, positions, prefix, cache, mask)
                            seconds += time.perf_counter() - start
                        times[factor].append(seconds / 5)
                medians = {factor: statistics.median(values) for factor, values in times.items()}
                first = medians[factors[0]]
                print(f"| {label} | " + " | ".join(f"{medians[f] * 1e3:.3f}" for f in factors) + " | "
                      + " | ".join(f"{medians[f] / first:.3f}" for f in factors[1:]) + " |", flush=True)
    finally:
        host_kernels._host_kernels = installed


if __name__ == "__main__":
    main()
