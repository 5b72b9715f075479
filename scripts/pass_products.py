"""Where a pass of several rows spends its time: the bundled target's lean forward of n new tokens over a
128-token prefix against its products alone (the same panels, ``PanelWeight.matmul_into``), 1 thread,
medians of 25 alternating pairs. docs/ENGINE.md, "Where a pass of several rows spends its time here".

    python scripts/pass_products.py                       # float32
    python scripts/pass_products.py --dtype bfloat16
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gbv.engine.tree_decoder import lean_model
from gbv.models.loading import load_pair


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", default="1,5,9,13,25", help="comma-separated pass sizes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lean = lean_model(load_pair("bundled", dtype=args.dtype).target)
    host = lean.host_forward
    if host is None or host.panels_off is not None:
        raise SystemExit("the compiled products do not run here (gbv --version says why)")
    panels = [product.panel for product in host.products()]
    prefix = 128
    print(f"| tokens | {args.dtype} forward, ms | its products, ms | products' share | products' GFLOP/s |")
    print("|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        cache = lean.new_cache(1, 512)
        lean.forward(torch.arange(prefix)[None] % 100, torch.arange(prefix)[None], 0, cache, None, causal=True)
        for n in (int(value) for value in args.tokens.split(",")):
            tokens, positions = torch.full((1, n), 7), prefix + torch.arange(n)[None]
            mask = torch.ones(1, 1, n, prefix + n, dtype=torch.bool) if n > 1 else None
            rows = [(np.zeros((n, w.in_features), np.float32), np.zeros((n, w.out_features), np.float32))
                    for w in panels]
            forward, products = [], []
            for _ in range(25):
                start = time.perf_counter()
                lean.forward(tokens, positions, prefix, cache, mask)
                forward.append(time.perf_counter() - start)
                start = time.perf_counter()
                for weight, (x, y) in zip(panels, rows):
                    weight.matmul_into(x, y)
                products.append(time.perf_counter() - start)
            f, p = statistics.median(forward), statistics.median(products)
            flops = 2 * n * sum(w.in_features * w.out_features for w in panels)
            print(f"| {n} | {f * 1e3:.2f} | {p * 1e3:.2f} | {p / f:.0%} | {flops / p / 1e9:.0f} |")


if __name__ == "__main__":
    main()
