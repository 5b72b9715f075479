"""gbv.bench.engine_goals: the engine benchmark's results read against issue 8's goals."""

from __future__ import annotations

import pytest

from gbv.bench.engine_goals import engine_goals, goals_markdown, goals_matrix_markdown, verifier_goals


def _row(tokens_per_s: float, prompts: int = 2, tokens: int = 100, wall_factor: float = 1.25,
         share: float = 0.95, nodes: float | None = None, wall: bool = True) -> list[dict]:
    """``prompts`` results of ``tokens`` tokens each at ``tokens_per_s`` after the prefill (end to end
    ``wall_factor`` times slower), forwards ``share`` of the time, ``nodes`` tree nodes a call."""
    seconds = tokens / tokens_per_s
    result = {"tokens": tokens, "seconds": seconds, "target_calls": 10, "phases": share * seconds,
              "tree_nodes": 10 * nodes if nodes else 0, "tree_calls": 10 if nodes else 0}
    if wall:
        result["wall"] = seconds * wall_factor
    return [dict(result) for _ in range(prompts)]


def _peer(tokens_per_s: float, prompts: int = 2, tokens: int = 100, old: bool = False) -> list[dict]:
    """A transformers row: end to end only (``wall``; ``seconds`` in files from before ``wall``)."""
    seconds = tokens / tokens_per_s
    return [{"tokens": tokens, "seconds": seconds if old else None, **({} if old else {"wall": seconds}),
             "target_calls": 10} for _ in range(prompts)]


MICRO = {"draft_step_ms": 0.12, "target_step_ms": 0.6, "target_matmuls_ms": 0.5, "target_step_over_matmuls": 1.2,
         "target_bytes": 16e6, "read_bandwidth_gb_s": 20.0}


def _table(ar=1000.0, block4=1500.0, auto=1450.0, best_other=1200.0, assisted=100.0, default=120.0,
           nodes=15.0, share=0.95):
    return {"ar": _row(ar), "block L=4": _row(block4), "block L=2": _row(best_other),
            "gbv K=3 L=8": _row(500.0, nodes=nodes, share=share), "auto": _row(auto),
            "hf-assisted L=4": _peer(assisted), "hf-assisted default": _peer(default), "hf-plain": _peer(90.0)}


def _met(goals) -> dict[str, bool | None]:
    return {goal.goal: goal.met for goal in goals}


def _find(goals, start: str):
    found = [goal for goal in goals if goal.goal.startswith(start)]
    assert len(found) == 1, [goal.goal for goal in goals]
    return found[0]


def test_every_goal_met_by_a_run_that_meets_it():
    goals = engine_goals(MICRO, {"0.2": _table(), "1.0": _table()})
    met = _met(goals)
    assert all(value is not False for value in met.values()), goals
    # every goal of the issue that this benchmark answers is there: 4 one-off goals, and per temperature
    # auto vs ar, vs the best fixed row, vs assisted generation (two), the bandwidth; BV L = 4 at T = 1 only
    assert len(goals) == 4 + 2 * 5 + 1
    assert _find(goals, "BV L = 4").measured == "1.50x"
    assert _find(goals, "`auto` at least 0.95x the best fixed row, T = 0.2").measured == "0.967x (block L=4)"
    assert _find(goals, "tree nodes").measured == "15.0 (0.56 K(L + 1))"
    bandwidth = _find(goals, "`ar`'s bandwidth achieved (target bytes x tokens/s), T = 1.0")
    assert bandwidth.met is None and bandwidth.measured.startswith("16.0 GB/s, 80%")
    # ours against transformers end to end (wall = 1.25 x seconds): ar 800 / 100, auto 1160 / 100
    assert _find(goals, "`ar` and `auto` at least 2.0x assisted generation with L = 4, T = 1.0").measured == \
        "8.0x and 11.6x"


@pytest.mark.parametrize("change, goal", [
    ({"draft_step_ms": 0.41}, "a draft forward"),
    ({"target_step_over_matmuls": 1.31}, "a 1-token target step"),
])
def test_one_off_goals_fail_past_their_thresholds(change, goal):
    assert _find(engine_goals({**MICRO, **change}, {"1.0": _table()}), goal).met is False
    assert _find(engine_goals(MICRO, {"1.0": _table()}), goal).met is True


def test_the_step_ratio_from_its_two_times_where_the_ratio_is_missing():
    micro = {key: value for key, value in MICRO.items() if key != "target_step_over_matmuls"}
    goal = _find(engine_goals(micro, {"1.0": _table()}), "a 1-token target step")
    assert goal.measured == "1.20x" and goal.met is True


@pytest.mark.parametrize("kwargs, temperature, goal", [
    ({"nodes": 16.3}, "0.2", "tree nodes"),  # 16.3 > 0.6 x 27 = 16.2
    ({"share": 0.89}, "1.0", "model forwards"),
    ({"block4": 1390.0, "auto": 1350.0}, "1.0", "BV L = 4 at least 1.4x `ar`, T = 1.0"),
    ({"auto": 990.0, "block4": 1000.0, "best_other": 900.0}, "0.2", "`auto` at least 1.0x `ar`, T = 0.2"),
    ({"auto": 1420.0}, "1.0", "`auto` at least 0.95x the best fixed row, T = 1.0"),  # 1420 / 1500 = 0.947
    ({"assisted": 401.0}, "1.0", "`ar` and `auto` at least 2.0x assisted generation with L = 4, T = 1.0"),
    ({"default": 1160.0}, "0.2", "`auto` faster than assisted generation with its own defaults, T = 0.2"),  # equal
])
def test_each_goal_on_the_rows_fails_just_past_its_threshold_and_no_other(kwargs, temperature, goal):
    tables = {"0.2": _table(), "1.0": _table()}
    tables[temperature] = _table(**kwargs)
    failing = [g.goal for g in engine_goals(MICRO, tables) if g.met is False]
    assert len(failing) == 1 and failing[0].startswith(goal), failing


def test_the_best_fixed_row_excludes_ar_auto_and_transformers():
    # ar and auto far ahead of every fixed row: the best fixed row is still block L=4
    goals = engine_goals(MICRO, {"1.0": _table(ar=2000.0, auto=3000.0, block4=1500.0)})
    assert _find(goals, "`auto` at least 0.95x the best fixed row").measured == "2.000x (block L=4)"


def test_a_threshold_itself_meets_its_goal():
    goals = engine_goals({**MICRO, "draft_step_ms": 0.4, "target_step_over_matmuls": 1.3},
                         {"1.0": _table(ar=1024.0, auto=1024.0, block4=1024.0, best_other=512.0)})
    for start in ("a draft forward", "a 1-token target step", "`auto` at least 1.0x"):
        assert _find(goals, start).met is True


def test_rows_the_run_lacks_leave_their_goals_out():
    table = _table()
    for label in ("hf-assisted L=4", "hf-assisted default", "hf-plain", "gbv K=3 L=8"):
        del table[label]
    goals = engine_goals(MICRO, {"1.0": table})  # (--no-hf, no multi-path row, no T = 0.2)
    assert not [g for g in goals if "assisted" in g.goal or "tree nodes" in g.goal]
    assert _find(goals, "BV L = 4").met is True


def test_an_older_file_compares_ours_after_the_prefill_and_says_so():
    table = _table()
    for label in ("ar", "block L=4", "block L=2", "gbv K=3 L=8", "auto"):
        table[label] = [{k: v for k, v in r.items() if k != "wall"} for r in table[label]]
    for label in ("hf-assisted L=4", "hf-assisted default"):
        table[label] = _peer(100.0 if label.endswith("L=4") else 120.0, old=True)
    goal = _find(engine_goals(MICRO, {"1.0": table}), "`ar` and `auto` at least 2.0x")
    assert goal.measured.startswith("10.0x and 14.5x (an older file") and goal.met is True


def test_the_markdown_marks_what_is_not_met():
    goals = engine_goals({**MICRO, "draft_step_ms": 0.5}, {"1.0": _table()})
    text = goals_markdown(goals)
    assert text.splitlines()[0] == "| goal (issue 8) | measured | met |"
    assert "| a draft forward at most 0.4 ms | 0.500 ms | **no** |" in text
    assert "| `auto` at least 1.0x `ar`, T = 1.0 | 1.45x | yes |" in text
    assert text.count("| - |") == 1  # the bandwidth: a figure to report, nothing to meet


def test_off_the_cpu_the_forwards_share_is_reported_not_judged():
    tables = {"1.0": _table(share=0.3)}
    assert _find(engine_goals(MICRO, tables), "model forwards").met is False
    goal = _find(engine_goals(MICRO, tables, device="cuda"), "model forwards")
    assert goal.met is None and "not judged" in goal.measured


def test_runs_side_by_side_one_row_per_goal_one_column_per_run():
    meets = engine_goals(MICRO, {"0.2": _table(), "1.0": _table()})
    misses = engine_goals({**MICRO, "draft_step_ms": 0.5}, {"1.0": _table(nodes=20.0)})  # no T = 0.2
    text = goals_matrix_markdown([("a", meets), ("b", misses)])
    lines = text.splitlines()
    assert lines[0] == "| goal (issue 8) | a | b |" and len(lines) == 2 + len(meets)
    assert "| a draft forward at most 0.4 ms | yes | **no** |" in lines
    assert "| `auto` at least 1.0x `ar`, T = 0.2 | yes |  |" in lines  # b has no T = 0.2
    assert "| `ar`'s bandwidth achieved (target bytes x tokens/s), T = 1.0: reported | - | - |" in lines


def test_the_verifier_goal_per_vocabulary():
    goals = verifier_goals({128000: 3.01, 32000: 3.0})
    assert [(g.goal, g.measured, g.met) for g in goals] == [
        ("one `gbv` verify call (K = 4, L = 8, V = 32000) at most 3x one softmax over p", "3.00x", True),
        ("one `gbv` verify call (K = 4, L = 8, V = 128000) at most 3x one softmax over p", "3.01x", False)]
