"""Aggregation and output files: results.jsonl, summary.csv, summary.md (written with gbv.atomic).

Definitions (SPEC section 0): **block efficiency** = generated tokens / target forward calls;
**accepted length** = drafted tokens accepted per iteration (block efficiency - 1 in expectation).
Every table header says which of the two a column shows.
"""

from __future__ import annotations

import csv
import io
import json
import math
import operator
import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np


class JsonlWriter:
    """Appends records to ``.NAME.partial`` (flushed per line, so a crash keeps what was done) and
    renames it to ``NAME`` on :meth:`close`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.partial = self.path.with_name(f".{self.path.name}.partial")
        self._fh = open(self.partial, "w", encoding="utf-8")
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)
        self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()
        os.replace(self.partial, self.path)


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# ---------------------------------------------------------------------- small statistics
def _finite(values: Iterable[Any]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def std(values: Iterable[Any]) -> float | None:
    vals = _finite(values)
    return float(np.std(vals, ddof=1)) if len(vals) > 1 else (0.0 if vals else None)


def iqr(values: Iterable[Any]) -> float | None:
    vals = _finite(values)
    if not vals:
        return None
    q75, q25 = np.percentile(vals, [75, 25])
    return float(q75 - q25)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def held_out_best(rows: dict[str, list[dict]], candidates: list[str], key: str = "seconds",
                  folds: int = 2) -> tuple[float, list[str]]:
    """The rate of the best candidate row, chosen without looking at the prompts it is measured on.

    ``rows[label]`` lists one result per prompt (``tokens`` and ``key`` seconds), the same prompts in the
    same order for every row. Prompt ``i`` is in fold ``i % folds``; for each fold, the candidate whose
    pooled rate (tokens over ``key``) is the best on the other folds; the rate of those choices, each
    measured on its own fold, pooled (total tokens over total seconds). Returns that rate and the label
    chosen for each fold.

    Why: the best of a dozen rows measured on the same prompts is partly the luckiest. Near-tied rows
    differ by less than a run's noise (the texts their seeds draw, the moments of a shared machine), and
    the maximum picks whichever that noise favoured, so it overstates what the best fixed setting makes
    where it was not picked on the same data. This rate is what a user who picks a fixed setting from
    one benchmark gets on other prompts.
    """
    if folds < 2:
        raise ValueError(f"folds must be at least 2, got {folds}")
    counts = {len(rows[label]) for label in candidates}
    if len(counts) != 1 or counts.pop() < folds:
        raise ValueError("every candidate row needs the same number of prompts, at least one per fold")

    def pooled(label: str, fold: int, inside: bool) -> tuple[float, float]:
        """Tokens and seconds of ``label`` over the prompts of ``fold`` (``inside``) or of the others."""
        picked = [r for i, r in enumerate(rows[label]) if (i % folds == fold) == inside]
        return sum(r["tokens"] for r in picked), sum(r[key] for r in picked)

    tokens = seconds = 0.0
    chosen = []
    for fold in range(folds):
        # (the first of equal rates, as max() keeps)
        label = max(candidates, key=lambda name: operator.truediv(*pooled(name, fold, inside=False)))
        chosen.append(label)
        fold_tokens, fold_seconds = pooled(label, fold, inside=True)
        tokens, seconds = tokens + fold_tokens, seconds + fold_seconds
    return tokens / seconds, chosen


# ---------------------------------------------------------------------- model benchmark summary
SUMMARY_COLUMNS: tuple[str, ...] = (
    "dataset", "method", "K", "L", "T", "prompts", "new_tokens", "target_calls",
    "block_efficiency", "block_efficiency_std", "block_efficiency_iqr", "mean_accepted_length",
    "tokens_per_s", "speedup_vs_ar", "speedup_vs_hf_assisted", "block_efficiency_vs_block",
)

SUMMARY_HEADERS: dict[str, str] = {
    "dataset": "dataset",
    "method": "method",
    "K": "K",
    "L": "L",
    "T": "T",
    "prompts": "prompts",
    "new_tokens": "new tokens",
    "target_calls": "target calls",
    "block_efficiency": "block eff. (tokens/target call)",
    "block_efficiency_std": "block eff. std over prompts",
    "block_efficiency_iqr": "block eff. IQR over prompts",
    "mean_accepted_length": "mean accepted length (drafted tokens kept/iter)",
    "tokens_per_s": "tokens/s",
    "speedup_vs_ar": "tokens/s vs ar",
    "speedup_vs_hf_assisted": "tokens/s vs hf-assisted",
    "block_efficiency_vs_block": "block eff. vs block (BV)",
}


POOLED = "all"


def _key(record: dict) -> tuple:
    return (record["dataset"], record["method"], record["K"], record["L"], record["T"])


def summarize(records: list[dict], method_order: list[str] | None = None) -> list[dict]:
    """One row per (dataset, method, K, L, T) with the totals and ratios of SUMMARY_COLUMNS; with more
    than one dataset, also rows for dataset ``all`` (every prompt of every dataset pooled)."""
    if len({r["dataset"] for r in records}) > 1:
        records = list(records) + [dict(r, dataset=POOLED) for r in records]
    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        groups.setdefault(_key(rec), []).append(rec)
    rows: list[dict] = []
    for key, recs in groups.items():
        dataset, method, k, l, t = key
        new_tokens = sum(int(r["new_tokens"]) for r in recs)
        calls = [r.get("target_calls") for r in recs]
        total_calls = None if any(c is None for c in calls) else sum(int(c) for c in calls)
        total_time = sum(float(r.get("time_total") or 0.0) for r in recs)
        per_prompt_be = [r["new_tokens"] / r["target_calls"] for r in recs
                         if r.get("target_calls") and r.get("new_tokens") is not None]
        acc = [a for r in recs for a in (r.get("accepted_lengths") or [])]
        have_acc = all(r.get("accepted_lengths") is not None for r in recs)
        rows.append({
            "dataset": dataset, "method": method, "K": k, "L": l, "T": t, "prompts": len(recs),
            "new_tokens": new_tokens, "target_calls": total_calls,
            "block_efficiency": ratio(new_tokens, total_calls),
            "block_efficiency_std": std(per_prompt_be) if total_calls is not None else None,
            "block_efficiency_iqr": iqr(per_prompt_be) if total_calls is not None else None,
            "mean_accepted_length": float(np.mean(acc)) if (have_acc and acc) else None,
            "tokens_per_s": ratio(new_tokens, total_time),
        })
    # Ratios against the baselines at the same (dataset, L, T); ar / hf-ar have no L: same (dataset, T).
    by_key = {(r["dataset"], r["method"], r["K"], r["L"], r["T"]): r for r in rows}
    for row in rows:
        ar = by_key.get((row["dataset"], "ar", 1, None, row["T"]))
        row["speedup_vs_ar"] = ratio(row["tokens_per_s"], ar["tokens_per_s"]) if ar else None
        hf = by_key.get((row["dataset"], "hf-assisted", 1, row["L"], row["T"])) if row["L"] is not None else None
        row["speedup_vs_hf_assisted"] = ratio(row["tokens_per_s"], hf["tokens_per_s"]) if hf else None
        bv = by_key.get((row["dataset"], "block", 1, row["L"], row["T"])) if row["L"] is not None else None
        row["block_efficiency_vs_block"] = ratio(row["block_efficiency"], bv["block_efficiency"]) if bv else None
    order = {m: i for i, m in enumerate(method_order or [])}
    rows.sort(key=lambda r: (r["dataset"] != POOLED, r["dataset"], r["T"], -1 if r["L"] is None else r["L"],
                             order.get(r["method"], len(order)), r["method"], r["K"]))
    return rows


# ---------------------------------------------------------------------- formatting
def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == int(value) and abs(value) < 1e6 and digits == 0:
            return str(int(value))
        return f"{value:.{digits}f}"
    return str(value)


def to_csv(rows: list[dict], columns: tuple[str, ...]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else (f"{row[c]:.6g}" if isinstance(row[c], float) else row[c])
                         for c in columns])
    return buf.getvalue()


def to_markdown(rows: list[dict], columns: tuple[str, ...], headers: dict[str, str],
                digits: dict[str, int] | None = None) -> str:
    digits = digits or {}
    lines = ["| " + " | ".join(headers.get(c, c) for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = []
        for c in columns:
            value = row.get(c)
            if c == "T" and isinstance(value, float):
                cells.append(f"{value:g}")
            else:
                cells.append(fmt(value, digits.get(c, 3)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_markdown(rows: list[dict], title: str, command: str | list[str] | None = None) -> str:
    """Markdown: one table per dataset; the column names say what each number is."""
    parts = [f"# {title}\n"]
    if isinstance(command, str):
        parts.append(f"Command: `{command}`\n")
    elif command:
        parts.append("Commands:\n\n" + "\n".join(f"- `{c}`" for c in command) + "\n")
    parts.append("Block efficiency = new tokens / target forward calls (= mean accepted length + 1, up to "
                 "truncation at max-new-tokens). Mean accepted length = drafted tokens kept per iteration. "
                 "tokens/s = new tokens / wall time of the generate call, the prompt's prefill included (end to end, "
                 "every row alike). Speedups are tokens/s ratios at the same (dataset, L, T) "
                 "(ar: same dataset, T). `-` = not applicable or not measured.\n")
    columns = tuple(c for c in SUMMARY_COLUMNS if c != "dataset")
    for dataset in sorted({r["dataset"] for r in rows}, key=lambda d: (d != POOLED, d)):
        parts.append(f"## {dataset}\n" if dataset != POOLED else "## all datasets pooled\n")
        parts.append(to_markdown([r for r in rows if r["dataset"] == dataset], columns, SUMMARY_HEADERS,
                                 {"tokens_per_s": 1, "prompts": 0, "new_tokens": 0, "target_calls": 0}))
    return "\n".join(parts)
