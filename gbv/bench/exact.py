"""``gbv bench --exact``: the benchmark tables computed exactly on random synthetic instances.

No models and no sampling noise: each instance draws target logits ``z ~ N(0, scale^2)`` for every
context of length ``0..L`` and draft logits ``z + N(0, noise^2)`` for every context of length
``0..L-1``; at temperature ``T`` both become ``softmax(logits / T)`` (``T = 0``: one-hot argmax), so the
same instance is seen at every temperature. Each verifier's expected accepted length is computed by
exact enumeration (:func:`gbv.theory.exact_analysis`, which also measures the law error), and the
information-agnostic LP optimum (:func:`gbv.theory.lp.lp_optimum`) is the ceiling row.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import numpy as np

from gbv.bench.report import iqr, ratio, std, to_markdown
from gbv.errors import GbvError
from gbv.theory.instance import Context, TinyInstance

MAX_VOCAB = 8
MAX_BLOCK_LEN = 4
MAX_INSTANCES = 1000
# V^(L*K) draft tuples are enumerated per method and instance; keep each tuple set small.
MAX_EXACT_TUPLES = 5000


def check_exact_sizes(vocab: int, block_lens: list[int], num_paths: list[int], instances: int) -> None:
    if vocab < 2 or vocab > MAX_VOCAB:
        raise GbvError(f"--vocab must be between 2 and {MAX_VOCAB} for --exact, got {vocab}")
    for block_len in block_lens:
        if block_len > MAX_BLOCK_LEN:
            raise GbvError(f"--block-len must be at most {MAX_BLOCK_LEN} for --exact, got {block_len}")
        for k in num_paths:
            tuples = vocab ** (block_len * k)
            if tuples > MAX_EXACT_TUPLES:
                raise GbvError(f"--exact grid too large: V^(L*K) = {vocab}^({block_len}*{k}) = {tuples} draft "
                               f"tuples (at most {MAX_EXACT_TUPLES}); lower --vocab, --block-len or --num-paths")
    if instances < 1 or instances > MAX_INSTANCES:
        raise GbvError(f"--instances must be between 1 and {MAX_INSTANCES}, got {instances}")


def random_logits(vocab: int, block_len: int, seed: int, scale: float, noise: float
                  ) -> tuple[dict[Context, np.ndarray], dict[Context, np.ndarray]]:
    rng = np.random.default_rng(seed)
    target: dict[Context, np.ndarray] = {}
    draft: dict[Context, np.ndarray] = {}
    for n in range(block_len + 1):
        for ctx in itertools.product(range(vocab), repeat=n):
            z = rng.normal(0.0, scale, size=vocab)
            target[ctx] = z
            if n < block_len:
                draft[ctx] = z + rng.normal(0.0, noise, size=vocab)
    return target, draft


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    if temperature == 0:
        out = np.zeros_like(logits)
        out[int(np.argmax(logits))] = 1.0  # ties: lowest id, as argmax
        return out
    z = logits / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def logit_instance(vocab: int, block_len: int, num_paths: int, seed: int, temperature: float,
                   scale: float = 2.0, noise: float = 1.0) -> TinyInstance:
    """A random instance from logits (see the module docstring); same seed -> same logits at every T."""
    target, draft = random_logits(vocab, block_len, seed, scale, noise)
    return TinyInstance(vocab, block_len, num_paths,
                        {c: apply_temperature(v, temperature) for c, v in target.items()},
                        {c: apply_temperature(v, temperature) for c, v in draft.items()})


def exact_records(vocab: int, block_lens: list[int], num_paths: list[int], temperatures: list[float],
                  methods: list[str], instances: int, seed: int, scale: float, noise: float,
                  progress: Callable[[int], None] | None = None, with_lp: bool = True) -> list[dict]:
    """One record per (instance, L, T, method, K): exact E[tau]; ``method = "lp"`` is the LP optimum."""
    from gbv.theory import exact_analysis
    from gbv.theory.lp import lp_optimum
    from gbv.verify import get_verifier, is_multi_path

    records: list[dict] = []
    for block_len in block_lens:
        for inst_idx in range(instances):
            inst_seed = seed * 100_003 + inst_idx
            for temp in temperatures:
                inst = logit_instance(vocab, block_len, max(num_paths), inst_seed, temp, scale, noise)
                for method in methods + (["lp"] if with_lp else []):
                    ks = num_paths if (method == "lp" or is_multi_path(method)) else [1]
                    for k in ks:
                        start = time.perf_counter()
                        if method == "lp":
                            accepted, law_error = lp_optimum(inst, k), None
                        else:
                            analysis = exact_analysis(get_verifier(method), inst, k)
                            accepted, law_error = analysis.expected_accepted, analysis.max_law_error
                        records.append({"instance": inst_idx, "instance_seed": inst_seed, "V": vocab,
                                        "L": block_len, "T": temp, "method": method, "K": k,
                                        "expected_accepted": accepted, "block_efficiency": accepted + 1.0,
                                        "max_law_error": law_error,
                                        "time_s": round(time.perf_counter() - start, 4)})
                        if progress is not None:
                            progress(1)
    return records


def count_exact_jobs(block_lens: list[int], num_paths: list[int], temperatures: list[float],
                     methods: list[str], instances: int, with_lp: bool = True) -> int:
    from gbv.verify import is_multi_path

    per = sum(len(num_paths) if is_multi_path(m) else 1 for m in methods) + (len(num_paths) if with_lp else 0)
    return per * len(block_lens) * len(temperatures) * instances


EXACT_COLUMNS: tuple[str, ...] = ("V", "L", "T", "method", "K", "instances", "expected_accepted",
                                  "expected_accepted_std", "expected_accepted_iqr", "block_efficiency",
                                  "fraction_of_lp", "vs_block", "max_law_error")
EXACT_HEADERS: dict[str, str] = {
    "V": "V", "L": "L", "T": "T", "method": "method", "K": "K", "instances": "instances",
    "expected_accepted": "accepted length E[tau] (mean over instances)",
    "expected_accepted_std": "E[tau] std over instances",
    "expected_accepted_iqr": "E[tau] IQR over instances",
    "block_efficiency": "block eff. E[tau]+1",
    "fraction_of_lp": "accepted length / LP optimum",
    "vs_block": "accepted length / BV",
    "max_law_error": "max law error",
}


def summarize_exact(records: list[dict], method_order: list[str]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        groups.setdefault((rec["V"], rec["L"], rec["T"], rec["method"], rec["K"]), []).append(rec)
    rows = []
    for (vocab, block_len, temp, method, k), recs in groups.items():
        acc = [r["expected_accepted"] for r in recs]
        errors = [r["max_law_error"] for r in recs if r["max_law_error"] is not None]
        rows.append({"V": vocab, "L": block_len, "T": temp, "method": method, "K": k, "instances": len(recs),
                     "expected_accepted": float(np.mean(acc)), "expected_accepted_std": std(acc),
                     "expected_accepted_iqr": iqr(acc), "block_efficiency": float(np.mean(acc)) + 1.0,
                     "max_law_error": max(errors) if errors else None})
    by_key = {(r["V"], r["L"], r["T"], r["method"], r["K"]): r for r in rows}
    for row in rows:
        lp = by_key.get((row["V"], row["L"], row["T"], "lp", row["K"]))
        row["fraction_of_lp"] = ratio(row["expected_accepted"], lp["expected_accepted"]) if lp else None
        bv = by_key.get((row["V"], row["L"], row["T"], "block", 1))
        row["vs_block"] = ratio(row["expected_accepted"], bv["expected_accepted"]) if bv else None
    order = {m: i for i, m in enumerate(method_order + ["lp"])}
    rows.sort(key=lambda r: (r["V"], r["L"], r["T"], order.get(r["method"], len(order)), r["K"]))
    return rows


def exact_markdown(rows: list[dict], command: str, description: str) -> str:
    parts = ["# Exact benchmark on synthetic instances\n", f"Command: `{command}`\n", description + "\n",
             "All numbers are exact expectations per instance (enumeration of every draft tuple and every "
             "random branch of the verifier), averaged over the instances; `lp` is the LP optimum over all "
             "lossless K-path verifiers (the ceiling). Accepted length = E[tau]; block efficiency = E[tau] + 1. "
             "`max law error` = largest deviation of the completed output law from the target law "
             "(losslessness check; ~1e-16 means exact).\n"]
    digits = {"expected_accepted": 4, "expected_accepted_std": 3, "expected_accepted_iqr": 3,
              "block_efficiency": 4, "fraction_of_lp": 3, "vs_block": 3, "instances": 0}
    columns = tuple(c for c in EXACT_COLUMNS if c not in ("V", "L", "T"))
    for (vocab, block_len, temp) in sorted({(r["V"], r["L"], r["T"]) for r in rows}):
        sel = [r for r in rows if (r["V"], r["L"], r["T"]) == (vocab, block_len, temp)]
        parts.append(f"## V = {vocab}, L = {block_len}, T = {temp:g}\n")
        table = to_markdown(sel, columns, EXACT_HEADERS, digits)
        # Law errors read better in scientific notation.
        lines = table.splitlines()
        for i, row in enumerate(sel):
            cells = lines[i + 2].split(" | ")
            err = row["max_law_error"]
            cells[-1] = ("-" if err is None else f"{err:.1e}") + " |"
            lines[i + 2] = " | ".join(cells)
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)
