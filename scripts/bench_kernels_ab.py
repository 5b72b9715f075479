"""Whole lean forwards and attention calls with the compiled kernels of ``gbv/engine/_host_kernels.c`` at
a commit against the installed ones, in one process, interleaved (1 thread, bundled pair).

    python scripts/bench_kernels_ab.py --before 4028ece                   # bfloat16, ~2 min
    python scripts/bench_kernels_ab.py --before 4028ece --dtype float32

1. Forwards of the lean target and draft over a 150-token prefix: n new tokens under a causal mask
   (what a block of n - 1 drafted tokens costs the target, or a depth step of n paths the draft).
2. Attention alone (``host_kernels.attention_into``): n queries under an all-true mask over 150 cached
   slots, 8 heads of 32 (the bundled models' shape).
3. The same under a tree mask: a root and K = 3 disjoint paths of L nodes (n = 3 L + 1, what GBV's
   target pass attends), after the prefix; also as forwards of the target (first table's rows "tree").
4. A prompt's prefill: the target's forward of 100, 500 and 1,000 tokens from slot 0 (causal).

``--hint temporal|non-temporal`` sets the panel kernel's prefetch hint on both builds (default: the
one this process chose at load; AMD Zen machines chose the non-temporal one, this project's Xeon the
temporal one).

Each measurement alternates the two builds 40 (forwards) or 60 (attention) times and prints the
medians and their ratio; the machine is shared, so only the ratios mean anything. The old file is
built with gcc beside the installed one (``scripts/kernels_at.py``); its functions must take the
same arguments.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gbv.engine import host_kernels
from gbv.engine.host_kernels import attention_into, host_kernels_unavailable
from gbv.engine.tree import prefix_then
from gbv.engine.tree_decoder import lean_model
from gbv.models.loading import load_pair
from kernels_at import kernels_at


avx512 = True  # whether the installed kernels run the AVX-512 tiles (main), which the other build then takes too
hint = None  # the prefetch hint both builds take (--hint: True = temporal), else the one chosen at load


def alternate(builds: dict, run, repeats: int, inner: int) -> dict[str, float]:
    """Median seconds of ``run()`` per build (each timed over ``inner`` calls), builds alternating."""
    times = {name: [] for name in builds}
    for _ in range(repeats):
        for name, module in builds.items():
            host_kernels._host_kernels = module
            # (the prefetch hint chosen at load lives in each module: a module swapped in keeps its
            # default, non-temporal, which on the Xeon made a float32 step 3x slower)
            if hint is not None:
                module.set_prefetch_temporal(hint)
            elif host_kernels.prefetch_temporal() is not None:
                module.set_prefetch_temporal(host_kernels.prefetch_temporal())
            module.set_avx512(avx512)  # (GBV_HOST_AVX512=0 switched the installed module's only)
            start = time.perf_counter()
            for _ in range(inner):
                run()
            times[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(values) for name, values in times.items()}


def paths_mask(num_paths: int, block_len: int) -> torch.Tensor:
    """(n, n) bool: node i attends node j, for a root (node 0) and ``num_paths`` disjoint paths of
    ``block_len`` nodes after it (path k's depth-d node is 1 + k L + d)."""
    n = 1 + num_paths * block_len
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:, 0] = True
    for k in range(num_paths):
        for d in range(block_len):
            mask[1 + k * block_len + d, 1 + k * block_len:1 + k * block_len + d + 1] = True
    return mask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit whose _host_kernels.c is 'before'")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prefix", type=int, default=150)
    parser.add_argument("--hint", choices=["temporal", "non-temporal"], default=None,
                        help="the prefetch hint of both builds (default: the one chosen at load)")
    args = parser.parse_args(argv)
    if host_kernels_unavailable():
        raise SystemExit(f"the compiled kernels do not run here: {host_kernels_unavailable()}")
    torch.set_num_threads(1)
    installed = host_kernels._host_kernels
    global avx512, hint
    avx512 = installed.avx512()
    hint = None if args.hint is None else args.hint == "temporal"
    builds = {"before": kernels_at(args.before), "after": installed}
    pair = load_pair("bundled", dtype=args.dtype)
    prefix = args.prefix
    try:
        print(f"1. Lean forwards over a {prefix}-token prefix, {args.dtype}, ms\n")
        print(f"| model | new tokens | {args.before} | now | now / before |\n|---|---:|---:|---:|---:|")
        for name, model in (("target", pair.target), ("draft", pair.draft)):
            lean = lean_model(model)
            with torch.inference_mode():
                cache = lean.new_cache(1, prefix + 64)
                lean.forward(torch.arange(prefix)[None] % 100, torch.arange(prefix)[None], 0, cache, None,
                             causal=True)
                for n in (1, 2, 3, 4, 5, 8, 9, 12, 25):
                    tokens = torch.full((1, n), 7)
                    positions = prefix + torch.arange(n)[None]
                    mask = prefix_then(torch.tril(torch.ones(n, n, dtype=torch.bool)), prefix) if n > 1 else None
                    ms = alternate(builds, lambda: lean.forward(tokens, positions, prefix, cache, mask), 40, 5)
                    print(f"| {name} | {n} | {ms['before'] * 1e3:.3f} | {ms['after'] * 1e3:.3f} | "
                          f"{ms['after'] / ms['before']:.3f} |")
                for block_len in (4, 8):  # the tries of K = 3 paths: 13 and 25 nodes
                    tree = paths_mask(3, block_len)
                    n = tree.shape[0]
                    tokens = torch.full((1, n), 7)
                    depth = tree.sum(dim=1) - 1
                    positions = prefix + depth[None]
                    mask = prefix_then(tree, prefix)
                    ms = alternate(builds, lambda: lean.forward(tokens, positions, prefix, cache, mask), 40, 5)
                    print(f"| {name} | tree {n} | {ms['before'] * 1e3:.3f} | {ms['after'] * 1e3:.3f} | "
                          f"{ms['after'] / ms['before']:.3f} |")

        print(f"\n2. Attention of n queries over {prefix} cached slots (8 heads of 32), us\n")
        print(f"| queries | {args.before} | now | now / before |\n|---:|---:|---:|---:|")
        rng = np.random.default_rng(0)
        heads, head_dim = 8, 32
        for n in (1, 2, 3, 5, 6, 8, 12, 25):
            end = prefix + n
            keys = rng.standard_normal((heads, end + 8, head_dim)).astype(np.float32)
            values = rng.standard_normal((heads, end + 8, head_dim)).astype(np.float32)
            qkv = rng.standard_normal((n, 3 * heads * head_dim)).astype(np.float32)
            out = np.zeros((n, heads * head_dim), np.float32)
            mask = np.ones((n, end), bool) if n > 1 else None
            us = alternate(builds, lambda: attention_into(qkv, keys, values, out, mask, heads, prefix, end, 0.2),
                           60, 20)
            print(f"| {n} | {us['before'] * 1e6:.1f} | {us['after'] * 1e6:.1f} | {us['after'] / us['before']:.3f} |")

        print(f"\n3. Attention of a root and 3 paths of L nodes after {prefix} cached slots (8 heads of 32), us\n")
        print(f"| L | queries | {args.before} | now | now / before |\n|---:|---:|---:|---:|---:|")
        for block_len in (1, 2, 4, 8):
            tree = paths_mask(3, block_len).numpy()
            n = tree.shape[0]
            end = prefix + n
            keys = rng.standard_normal((heads, end + 8, head_dim)).astype(np.float32)
            values = rng.standard_normal((heads, end + 8, head_dim)).astype(np.float32)
            qkv = rng.standard_normal((n, 3 * heads * head_dim)).astype(np.float32)
            out = np.zeros((n, heads * head_dim), np.float32)
            mask = np.ones((n, end), bool)
            mask[:, prefix:] = tree
            us = alternate(builds, lambda: attention_into(qkv, keys, values, out, mask, heads, prefix, end, 0.2),
                           60, 20)
            print(f"| {block_len} | {n} | {us['before'] * 1e6:.1f} | {us['after'] * 1e6:.1f} | "
                  f"{us['after'] / us['before']:.3f} |")

        print(f"\n4. The target's prefill of a prompt from slot 0 (causal), {args.dtype}, ms\n")
        print(f"| tokens | {args.before} | now | now / before |\n|---:|---:|---:|---:|")
        lean = lean_model(pair.target)
        with torch.inference_mode():
            cache = lean.new_cache(1, 1030)
            for n in (100, 500, 1000):
                tokens, positions = torch.arange(n)[None] % 1000, torch.arange(n)[None]
                ms = alternate(builds, lambda: lean.forward(tokens, positions, 0, cache, None, causal=True,
                                                            last_only=True), 8, 1)
                print(f"| {n} | {ms['before'] * 1e3:.1f} | {ms['after'] * 1e3:.1f} | "
                      f"{ms['after'] / ms['before']:.3f} |")
    finally:
        host_kernels._host_kernels = installed


if __name__ == "__main__":
    main()
