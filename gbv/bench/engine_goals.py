"""The engine benchmark's results against the goals of the engine-speed issue (issue 8), goal by goal
(and the verifier micro-benchmark's one goal: :func:`verifier_goals`).

``scripts/bench_engine.py`` prints this table under each dtype's results, and again for saved runs
(``--goals-of FILE.json ...``, side by side for several), so that whether a goal holds is read off a measured run
by one rule, the same for every run and machine, not assembled by hand from several tables.

Input: one dtype's part of the benchmark's report: ``micro`` (the one-off measurements: ``draft_step_ms``,
``target_step_over_matmuls``, ``target_bytes``, ``read_bandwidth_gb_s``, ...) and ``temperatures``
(``str(T)`` -> row label -> one result per prompt: ``tokens``, ``seconds`` after the prefill, ``wall`` end to
end, ``target_calls``, ``phases`` (draft + target seconds), ``tree_nodes``, ``tree_calls``). Row labels are
the benchmark's: ``ar``, ``block L=4``, ``gbv K=3 L=8``, ``auto``, ``hf-assisted L=4``, ``hf-assisted default``;
a fixed row is any of ours but ``ar`` and ``auto``.

Each goal's rate is pooled (total tokens / total seconds) as in the benchmark's tables. Comparisons among our
rows use the rate after the prefill; comparisons with transformers' rows use end-to-end rates for both sides
(transformers' rows have no other time). Files written before end-to-end rates existed (no ``wall``) compare
our rates after the prefill with transformers' end to end, which flatters ours; the row says so.
"""

from __future__ import annotations

from dataclasses import dataclass

# The thresholds.
DRAFT_FORWARD_MS = 0.4
STEP_OVER_MATMULS = 1.3
TREE_NODE_SHARE = 0.6  # of K (L + 1) nodes, at T = 0.2, K = 3, L = 8
FORWARD_SHARE = 0.9
BLOCK_OVER_AR = 1.4  # BV L = 4 at T = 1
AUTO_OVER_AR = 1.0
AUTO_OVER_BEST_FIXED = 0.95
OVER_ASSISTED = 2.0  # ar and auto against assisted generation at the same settings (L = 4)

TREE_ROW, TREE_PATHS, TREE_BLOCK = "gbv K=3 L=8", 3, 8
VERIFY_OVER_SOFTMAX = 3.0  # one GBV verify call at K = 4, L = 8 against one softmax over p (scripts/bench_verifiers.py)
VERIFY_PATHS, VERIFY_BLOCK = 4, 8


@dataclass(frozen=True)
class Goal:
    """One goal: what the issue asks, what the run measured, and whether that meets it (None: nothing to
    meet, a figure the issue asks to report)."""

    goal: str
    measured: str
    met: bool | None


def pooled_rate(results: list[dict], key: str = "seconds") -> float | None:
    """Pooled tokens/s (total tokens / total ``key`` seconds: ``seconds`` after the prefill, ``wall`` end to end)
    of a row's results; None where a result has no such time (transformers' rows after the prefill)."""
    if not results or any(r.get(key) is None for r in results):
        return None
    seconds = sum(r[key] for r in results)
    return sum(r["tokens"] for r in results) / seconds if seconds > 0 else None


def _peer_rate(results: list[dict]) -> float | None:
    """A transformers row's end-to-end rate: ``wall``, or ``seconds`` in files from before ``wall`` existed
    (where its ``seconds`` were already end to end)."""
    return pooled_rate(results, "wall" if results and results[0].get("wall") is not None else "seconds")


def is_fixed_row(label: str) -> bool:
    """Whether a row is one of our fixed (method, K, L) settings: not ``ar``, ``auto`` or a transformers row."""
    return label not in ("ar", "auto") and not label.startswith("hf")


def _is_temperature(key: str, value: float) -> bool:
    """Whether the results' key ``key`` (``str(T)``) is temperature ``value``."""
    return abs(float(key) - value) < 1e-9


def _met_cell(goal: Goal) -> str:
    return "-" if goal.met is None else ("yes" if goal.met else "**no**")


def _yes(value: float | None, threshold: float, at_most: bool = False) -> bool | None:
    if value is None:
        return None
    return value <= threshold if at_most else value >= threshold


def engine_goals(micro: dict, temperatures: dict, device: str = "cpu") -> list[Goal]:
    """The goals of issue 8 that one dtype's benchmark results can answer, in the issue's order. A goal
    whose rows the run lacks (``--no-hf``, no T = 0.2) is left out. Off the CPU (``device``) the phase
    clocks are read without a device synchronisation, so the forwards' share is not judged there."""
    goals: list[Goal] = []
    draft_ms = micro.get("draft_step_ms")
    if draft_ms is not None:
        goals.append(Goal(f"a draft forward at most {DRAFT_FORWARD_MS} ms", f"{draft_ms:.3f} ms",
                          _yes(draft_ms, DRAFT_FORWARD_MS, at_most=True)))
    over = micro.get("target_step_over_matmuls")
    if over is None and micro.get("target_matmuls_ms"):
        over = micro["target_step_ms"] / micro["target_matmuls_ms"]
    if over is not None:
        goals.append(Goal(f"a 1-token target step at most {STEP_OVER_MATMULS}x its matrix multiplies",
                          f"{over:.2f}x", _yes(over, STEP_OVER_MATMULS, at_most=True)))
    cold = next((rows for key, rows in temperatures.items() if _is_temperature(key, 0.2)), None)
    if cold is not None and TREE_ROW in cold:
        rows = cold[TREE_ROW]
        calls = sum(r.get("tree_calls") or 0 for r in rows)
        if calls:
            nodes = sum(r.get("tree_nodes") or 0 for r in rows) / calls
            share = nodes / (TREE_PATHS * (TREE_BLOCK + 1))
            goals.append(Goal(f"tree nodes per target call at T = 0.2, K = {TREE_PATHS}, L = {TREE_BLOCK} at most "
                              f"{TREE_NODE_SHARE} K(L + 1) = {TREE_NODE_SHARE * TREE_PATHS * (TREE_BLOCK + 1):.1f}",
                              f"{nodes:.1f} ({share:.2f} K(L + 1))", _yes(share, TREE_NODE_SHARE, at_most=True)))
    shares = [(sum(r["phases"] for r in rows) / sum(r["seconds"] for r in rows), label, key)
              for key, table in temperatures.items() for label, rows in table.items()
              if rows and all(r.get("phases") is not None and r.get("seconds") for r in rows)]
    if shares:
        low, label, key = min(shares)
        on_cpu = device == "cpu"
        goals.append(Goal(f"model forwards (draft and target phases) at least {FORWARD_SHARE:.0%} of every row's time",
                          f"{low:.1%} at the least ({label}, T = {key})" + (
                              "" if on_cpu else f"; on {device} the phase clocks count launches, not the device's "
                                                "time, so this is not judged"),
                          _yes(low, FORWARD_SHARE) if on_cpu else None))
    for key, table in temperatures.items():
        goals += _rate_goals(key, table, micro)
    return goals


def _rate_goals(key: str, table: dict, micro: dict) -> list[Goal]:
    """The goals on rates at one temperature."""
    goals: list[Goal] = []
    ar = pooled_rate(table.get("ar", []), "seconds")
    if ar is None:
        return goals
    if micro.get("target_bytes") and micro.get("read_bandwidth_gb_s"):
        achieved = micro["target_bytes"] * ar / 1e9
        goals.append(Goal(f"`ar`'s bandwidth achieved (target bytes x tokens/s), T = {key}: reported",
                          f"{achieved:.1f} GB/s, {achieved / micro['read_bandwidth_gb_s']:.0%} of the "
                          f"{micro['read_bandwidth_gb_s']:.1f} GB/s measured", None))
    if _is_temperature(key, 1.0) and "block L=4" in table:
        block = pooled_rate(table["block L=4"], "seconds") / ar
        goals.append(Goal(f"BV L = 4 at least {BLOCK_OVER_AR}x `ar`, T = {key}", f"{block:.2f}x",
                          _yes(block, BLOCK_OVER_AR)))
    auto = pooled_rate(table.get("auto", []), "seconds")
    if auto is None:
        return goals
    goals.append(Goal(f"`auto` at least {AUTO_OVER_AR}x `ar`, T = {key}", f"{auto / ar:.2f}x",
                      _yes(auto / ar, AUTO_OVER_AR)))
    fixed = {label: pooled_rate(rows, "seconds") for label, rows in table.items() if is_fixed_row(label)}
    fixed = {label: rate for label, rate in fixed.items() if rate}
    if fixed:
        best = max(fixed, key=fixed.get)
        goals.append(Goal(f"`auto` at least {AUTO_OVER_BEST_FIXED}x the best fixed row, T = {key}",
                          f"{auto / fixed[best]:.3f}x ({best})", _yes(auto / fixed[best], AUTO_OVER_BEST_FIXED)))
    # (transformers' rows have only an end-to-end time: ours are compared with them end to end too)
    end_to_end = all(r.get("wall") is not None for label in ("ar", "auto") for r in table[label])
    ours_key = "wall" if end_to_end else "seconds"
    caveat = "" if end_to_end else " (an older file: ours after the prefill against transformers' end to end)"
    ours = {label: pooled_rate(table[label], ours_key) for label in ("ar", "auto")}
    assisted, default = (_peer_rate(table.get(label, [])) for label in ("hf-assisted L=4", "hf-assisted default"))
    if assisted:
        goals.append(Goal(f"`ar` and `auto` at least {OVER_ASSISTED}x assisted generation with L = 4, T = {key}",
                          f"{ours['ar'] / assisted:.1f}x and {ours['auto'] / assisted:.1f}x{caveat}",
                          min(ours.values()) / assisted >= OVER_ASSISTED))
    if default:
        goals.append(Goal(f"`auto` faster than assisted generation with its own defaults, T = {key}",
                          f"{ours['auto'] / default:.1f}x{caveat}", ours["auto"] > default))
    return goals


def verifier_goals(ratios: dict[int, float]) -> list[Goal]:
    """The verifier micro-benchmark's goal: a ``gbv`` verify call at K = 4, L = 8 costs at most 3x one
    softmax over ``p`` in the same process; ``ratios``: vocabulary size -> that ratio of the means."""
    return [Goal(f"one `gbv` verify call (K = {VERIFY_PATHS}, L = {VERIFY_BLOCK}, V = {vocab}) at most "
                 f"{VERIFY_OVER_SOFTMAX:g}x one softmax over p", f"{ratio:.2f}x", ratio <= VERIFY_OVER_SOFTMAX)
            for vocab, ratio in sorted(ratios.items())]


def goals_markdown(goals: list[Goal]) -> str:
    """The goals as a markdown table (goal, measured, met)."""
    lines = ["| goal (issue 8) | measured | met |", "|---|---|---|"]
    for goal in goals:
        lines.append(f"| {goal.goal} | {goal.measured} | {_met_cell(goal)} |")
    return "\n".join(lines)


def goals_matrix_markdown(columns: list[tuple[str, list[Goal]]]) -> str:
    """Several runs side by side: one row per goal (in the order first met), one column per ``(name,
    goals)`` run, each cell whether the run met it (``-``: nothing to meet or not judged; blank: the run
    does not answer it)."""
    order: list[str] = []
    cells: list[dict[str, str]] = []
    for _, goals in columns:
        column = {}
        for goal in goals:
            if goal.goal not in order:
                order.append(goal.goal)
            column[goal.goal] = _met_cell(goal)
        cells.append(column)
    lines = ["| goal (issue 8) | " + " | ".join(name for name, _ in columns) + " |",
             "|---|" + "---|" * len(columns)]
    lines += [f"| {goal} | " + " | ".join(column.get(goal, "") for column in cells) + " |" for goal in order]
    return "\n".join(lines)


__all__ = ["Goal", "engine_goals", "goals_markdown", "goals_matrix_markdown", "is_fixed_row", "pooled_rate",
           "verifier_goals"]
