"""Paired ratios with bootstrap intervals from a ``gbv bench`` results.jsonl.

    python -m gbv.bench.compare DIR [--method gbv] [--against block,specinfer,spectr,traversal]
                                    [--metric block_efficiency|tokens_per_s] [--resamples 2000] [--seed 0]

Prints a markdown table: for every (T, L, K >= 2; K = 1 for single-path methods) of ``--method``, the ratio of its pooled metric
(total new tokens / total target calls, or / total time) to each other method's at the same (L, T)
and the same K (single-path methods: K = 1), with a 95% percentile-bootstrap interval that
resamples prompts (dataset, prompt index) with replacement, paired across the two methods.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from gbv.bench.grid import NO_DRAFT, SINGLE_PATH
from gbv.bench.report import read_jsonl


def _table(records: list[dict]) -> dict[tuple, dict[tuple, tuple[float, float, float]]]:
    by_setting: dict[tuple, dict[tuple, tuple[float, float, float]]] = {}
    for r in records:
        key = (r["method"], r["K"], r["L"], r["T"])
        by_setting.setdefault(key, {})[(r["dataset"], r["prompt_index"])] = (
            float(r["new_tokens"]), float(r["target_calls"] or 0), float(r["time_total"] or 0.0))
    return by_setting


def paired_ratio(a: dict, b: dict, metric: str, resamples: int, rng: np.random.Generator
                 ) -> tuple[float, float, float, int]:
    common = sorted(set(a) & set(b))
    if not common:
        return float("nan"), float("nan"), float("nan"), 0
    x, y = np.array([a[c] for c in common]), np.array([b[c] for c in common])
    den = 1 if metric == "block_efficiency" else 2

    def value(ix: np.ndarray) -> float:
        return (x[ix, 0].sum() / x[ix, den].sum()) / (y[ix, 0].sum() / y[ix, den].sum())

    point = value(np.arange(len(common)))
    boots = [value(rng.integers(0, len(common), len(common))) for _ in range(resamples)]
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return float(point), float(lo), float(hi), len(common)


def compare(records: list[dict], method: str, against: list[str], metric: str = "block_efficiency",
            resamples: int = 2000, seed: int = 0) -> str:
    table = _table(records)
    rng = np.random.default_rng(seed)
    min_k = 1 if method in SINGLE_PATH else 2  # K = 1 of a multi-path method is its single-path version
    keys = sorted({(k[3], k[2], k[1]) for k in table if k[0] == method and k[1] >= min_k})
    names = {"block": "BV"}
    lines = [f"| T | L | K | " + " | ".join(f"{method} / {names.get(o, o)}" for o in against) + " |",
             "|---|---|---|" + "---|" * len(against)]
    n_prompts = 0
    for temp, block_len, k in keys:
        cells = []
        for other in against:
            k_other = 1 if other in SINGLE_PATH or other in NO_DRAFT else k
            l_other = None if other in NO_DRAFT else block_len
            b = table.get((other, k_other, l_other, temp))
            if b is None:
                cells.append("-")
                continue
            point, lo, hi, n = paired_ratio(table[(method, k, block_len, temp)], b, metric, resamples, rng)
            n_prompts = max(n_prompts, n)
            cells.append(f"{point:.3f} [{lo:.2f}, {hi:.2f}]")
        lines.append(f"| {temp:g} | {block_len} | {k} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"{metric} ratios, pooled over {n_prompts} prompts; [95% bootstrap interval over prompts, "
                 f"{resamples} resamples, seed {seed}]")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gbv.bench.compare", description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="a gbv bench output folder (with results.jsonl)")
    ap.add_argument("--method", default="gbv")
    ap.add_argument("--against", default="block,specinfer,spectr,traversal")
    ap.add_argument("--metric", default="block_efficiency", choices=("block_efficiency", "tokens_per_s"))
    ap.add_argument("--resamples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = Path(args.dir) / "results.jsonl"
    if not path.is_file():
        print(f"error: {path} not found", file=sys.stderr)
        return 2
    print(compare(read_jsonl(path), args.method, args.against.split(","), args.metric, args.resamples,
                  args.seed), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
