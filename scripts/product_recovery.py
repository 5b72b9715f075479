"""How fast the bundled target's 1-row products come back to speed after other work (1 thread, bf16).

    python scripts/product_recovery.py            # ~1 min
    python scripts/product_recovery.py --rounds 40

Each round runs one "before" workload, then times ten 1-row products over all of the target's
matrices (bf16 panels, 15.7 MB: what an ``ar`` step streams) one by one; the table gives the median
milliseconds of the 1st .. 10th product after each workload, over the rounds. Workloads: ten more
1-row products (steady), three 25-row products over the same matrices, four BV-like rounds (two
1-row draft products and a 3-row target product), eight 1-row draft products, a 5 ms Python spin,
a sum over 256 MB, a 5 ms sleep. A second table does the same with a compute probe instead: ten
rounds of a 25-row product over a (256, 256) weight that stays in the L2. If the probe settles at
once while the target's products do not, the slow steps after a switch come from where the weights
are (the L3), not from the core's clock (docs/ENGINE.md, "`auto`: ar in stretches").
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from gbv.engine.host_kernels import PanelWeight, host_kernels_unavailable
from gbv.engine.tree_decoder import lean_model
from gbv.models.loading import load_pair


def _products(host, rows: int):
    """All of a host forward's matrix products (every layer's and the LM head) for ``rows`` rows."""
    panels = [p.panel for layer in host.layers for p in (layer[0], layer[2], layer[3], layer[4])]
    panels.append(host.lm_head.panel)
    xs = [np.ones((rows, p.in_features), np.float32) for p in panels]
    ys = [np.zeros((rows, p.out_features), np.float32) for p in panels]
    return lambda: [p.matmul_into(x, y) for x, y, p in zip(xs, ys, panels)]


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    reason = host_kernels_unavailable()
    if reason is not None:
        raise SystemExit(f"the compiled kernels do not run here: {reason}")
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype="bfloat16")
    target, draft = lean_model(pair.target).host_forward, lean_model(pair.draft).host_forward
    one, three, many, draft_one = _products(target, 1), _products(target, 3), _products(target, 25), _products(draft, 1)
    big = np.ones(64 * 1024 * 1024, np.float32)
    workloads = {"ten 1-row products (steady)": lambda: [one() for _ in range(10)],
                 "three 25-row products": lambda: [many() for _ in range(3)],
                 "four BV-like rounds": lambda: [(draft_one(), draft_one(), three()) for _ in range(4)],
                 "eight 1-row draft products": lambda: [draft_one() for _ in range(8)],
                 "5 ms spin": lambda: _spin(5.0),
                 "sum over 256 MB": lambda: big.sum(),
                 "5 ms sleep": lambda: time.sleep(0.005)}
    probe_weight = PanelWeight(torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
                               .to(torch.bfloat16).float(), bf16=True)
    x, y = np.ones((25, 256), np.float32), np.zeros((25, 256), np.float32)

    def probe():
        for _ in range(10):
            probe_weight.matmul_into(x, y)

    for title, timed in (("target's 1-row products (15.7 MB of bf16 panels)", one),
                         ("compute probe (25 rows by a (256, 256) weight in the L2, ten times)", probe)):
        times = {name: [] for name in workloads}
        for _ in range(args.rounds):
            for name, workload in workloads.items():
                workload()
                row = []
                for _ in range(10):
                    start = time.perf_counter()
                    timed()
                    row.append(time.perf_counter() - start)
                times[name].append(row)
        print(f"\n{title}: median ms of the 1st .. 10th call after each workload, {args.rounds} rounds\n")
        print("| after | " + " | ".join(str(i) for i in range(1, 11)) + " |\n|---|" + "---:|" * 10)
        for name, rows in times.items():
            medians = np.median(np.array(rows), axis=0) * 1e3
            print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in medians) + " |")


if __name__ == "__main__":
    main()
