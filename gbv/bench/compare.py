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

from gbv.bench.grid import NO_DRAFT, is_single_path
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
    """Ratio of the pooled metric of ``a`` to ``b`` over their common prompts, with a 95% percentile
    bootstrap interval (:func:`scipy.stats.bootstrap`, ``paired``: one resample of prompts serves both)."""
    from scipy.stats import bootstrap

    common = sorted(set(a) & set(b))
    if not common:
        return float("nan"), float("nan"), float("nan"), 0
    x, y = np.array([a[c] for c in common]), np.array([b[c] for c in common])
    den = 1 if metric == "block_efficiency" else 2

    def ratio(x_new, x_den, y_new, y_den, axis=-1):
        return (x_new.sum(axis) / x_den.sum(axis)) / (y_new.sum(axis) / y_den.sum(axis))

    data = (x[:, 0], x[:, den], y[:, 0], y[:, den])
    point = float(ratio(*data))
    if len(common) < 2:  # one prompt: nothing to resample
        return point, point, point, 1
    result = bootstrap(data, ratio, paired=True, vectorized=True, n_resamples=resamples, method="percentile",
                       confidence_level=0.95, random_state=rng)
    interval = result.confidence_interval
    return point, float(interval.low), float(interval.high), len(common)


def compare(records: list[dict], method: str, against: list[str], metric: str = "block_efficiency",
            resamples: int = 2000, seed: int = 0) -> str:
    table = _table(records)
    rng = np.random.default_rng(seed)
    min_k = 1 if is_single_path(method) else 2  # K = 1 of a multi-path method is its single-path version
    keys = sorted({(k[3], k[2], k[1]) for k in table if k[0] == method and k[1] >= min_k})
    names = {"block": "BV"}
    lines = ["| T | L | K | " + " | ".join(f"{method} / {names.get(o, o)}" for o in against) + " |",
             "|---|---|---|" + "---|" * len(against)]
    n_prompts = 0
    for temp, block_len, k in keys:
        cells = []
        for other in against:
            k_other = 1 if is_single_path(other) or other in NO_DRAFT else k
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
