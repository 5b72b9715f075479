#!/usr/bin/env python3
"""Share of the LP optimum per instance, from the results.jsonl of `gbv bench --exact` runs.

For each (draft noise, T, K) row and each method: the mean and the worst of E[tau] / LP optimum over
the instances, and the number of instances where the method is below BV (E[tau] smaller than
`block`'s by more than 1e-12). Several run folders (e.g. one per --draft-noise, or more seeds) are
merged; the noise scale is read from each folder's meta.json. Prints a markdown table.

    python3 scripts/exact_shares.py docs/results/exact_noise_0.05 docs/results/exact_noise_0.3 ...
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def load(folders: list[str]) -> dict:
    """(noise, T, K, instance key) -> {method: E[tau]}; block (K = 1) is copied to every K."""
    table: dict = defaultdict(dict)
    for folder in folders:
        meta = json.loads((Path(folder) / "meta.json").read_text())
        noise = meta["draft_noise"]
        records = [json.loads(line) for line in (Path(folder) / "results.jsonl").read_text().splitlines() if line]
        ks = sorted({r["K"] for r in records if r["method"] == "lp"})
        for r in records:
            inst = (r["instance_seed"], r["V"], r["L"])
            for k in (ks if r["method"] == "block" else [r["K"]]):
                table[(noise, r["T"], k, inst)][r["method"]] = r["expected_accepted"]
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--methods", default="block,gbv,gbv-adaptive")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    table = load(args.folders)
    rows: dict = defaultdict(lambda: defaultdict(list))
    for (noise, temp, k, _), values in table.items():
        for m in methods:
            if m in values and values.get("lp"):
                rows[(noise, temp, k)][m].append((values[m] / values["lp"], values[m] < values["block"] - 1e-12))
    head = "| noise | T | K | n | " + " | ".join(f"{m} mean / worst / <BV" for m in methods) + " |"
    lines = [head, "|" + "---:|" * (4 + len(methods))]
    totals: dict = defaultdict(list)
    for key in sorted(rows):
        cells = []
        for m in methods:
            vals = rows[key][m]
            totals[m] += vals
            shares = [s for s, _ in vals]
            cells.append(f"{sum(shares) / len(shares):.4f} / {min(shares):.4f} / {sum(b for _, b in vals)}")
        n = len(rows[key][methods[0]])
        lines.append(f"| {key[0]:g} | {key[1]:g} | {key[2]} | {n} | " + " | ".join(cells) + " |")
    cells = []
    for m in methods:
        shares = [s for s, _ in totals[m]]
        below = sum(b for _, b in totals[m])
        cells.append(f"{sum(shares) / len(shares):.4f} / {min(shares):.4f} / {below} ({100 * below / len(shares):.1f}%)")
    lines.append(f"| all | | | {len(totals[methods[0]])} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if "gbv" in methods and "gbv-adaptive" in methods:
        worse = [key for key in sorted(rows) if _mean(rows[key]["gbv-adaptive"]) < _mean(rows[key]["gbv"]) - 1e-12]
        print(f"\nrows where gbv-adaptive's mean share is below gbv's: {len(worse)} of {len(rows)}"
              + (f" {worse}" if worse else ""))
    return 0


def _mean(vals: list[tuple[float, bool]]) -> float:
    return sum(s for s, _ in vals) / len(vals)


if __name__ == "__main__":
    sys.exit(main())
