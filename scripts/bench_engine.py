"""Engine benchmark on the bundled pair: every method against ``ar`` and transformers, in one run.

    python scripts/bench_engine.py                                  # 20 GSM8K + 20 HumanEval prompts, 128 tokens
    python scripts/bench_engine.py --dtype float32,bfloat16 --temperature 0.2,1.0 --out docs/results/engine.md
    python scripts/bench_engine.py --goals-of docs/results/engine/*.md.json       # the goals of saved runs

Rows (all in one process, 1 torch thread, EOS off so every row makes exactly ``--max-new-tokens``
tokens per prompt; prompts run round-robin over the rows so that load drift on a shared machine hits
every row alike):

- ours: ``ar``, ``token``/``block`` (one path), the multi-path verifiers at K = 3, and ``auto``
  (its policy learns over the prompts of the run, as it would in a server process; its exploration
  is included in its time);
- ``hf-assisted L=4``: transformers' assisted generation with a constant block of 4 (threshold off);
- ``hf-assisted default``: assisted generation with its own defaults (dynamic block length,
  confidence threshold), what a user gets without tuning;
- ``hf-plain``: ``target.generate``.

Reported per (dtype, temperature): pooled tokens/s (total tokens / total seconds) and its ratio to
``ar``, twice: over the generation after the prompt's prefill (``stats.time_total``; the draft's prompt,
where ``auto`` feeds it later, counts as prefill as a fixed row's does), and end to end (the wall time
of the ``generate`` call, the prefill included: the only time transformers' rows have, so they are
compared with ours on it), block efficiency, mean target tree nodes per call, the share of wall time spent in the draft
and target phases (model forwards plus sampling), and one-off micro-measurements: a draft forward, a
1-token target step against the time of its matrix multiplies alone, a 25-token tree pass against a
1-token step, and the bandwidth ``ar`` achieves (target bytes x tokens/s) against the machine's read
bandwidth. Medians over ``--repeats`` micro-runs; everything noisy on a shared machine. Under each dtype, the
goals of the engine-speed issue, met or not (``gbv.bench.engine_goals``); ``--goals-of`` prints them for saved runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from gbv.bench.engine_goals import engine_goals, goals_markdown, goals_matrix_markdown, is_fixed_row, pooled_rate
from gbv.bench.report import held_out_best
from gbv.engine.generate import generate
from gbv.engine import tree_decoder
from gbv.engine.static_steps import StaticSteps
from gbv.engine.tree_decoder import lean_model
from gbv.models.loading import load_pair
from gbv.verify import METHODS
from prompt_sets import benchmark_prompts


def rows_for(include_hf: bool) -> list[tuple[str, str, int, int]]:
    """(label, method, K, L)."""
    rows = [("ar", "ar", 1, 1), ("token L=4", "token", 1, 4), ("block L=2", "block", 1, 2),
            ("block L=4", "block", 1, 4), ("block L=8", "block", 1, 8)]
    multi = [m for m in ("gbv", "gbv-adaptive", "traversal", "specinfer", "spectr") if m in METHODS]
    for method in multi:
        for length in (4, 8):
            if method in ("specinfer", "spectr") and length == 8:
                continue
            rows.append((f"{method} K=3 L={length}", method, 3, length))
    rows.append(("auto", "auto", 0, 0))
    if include_hf:
        rows += [("hf-assisted L=4", "hf-assisted", 0, 4), ("hf-assisted default", "hf-default", 0, 0),
                 ("hf-plain", "hf-plain", 0, 0)]
    return rows


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_hf(pair, ids: list[int], kind: str, block_len: int, max_new: int, temperature: float, seed: int) -> dict:
    target, draft = pair.target, pair.draft
    input_ids = torch.tensor([ids], device=pair.device)
    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new, min_new_tokens=max_new,
                  do_sample=temperature > 0, top_k=0, top_p=1.0, pad_token_id=0)
    if temperature > 0:
        kwargs["temperature"] = temperature
    saved = {k: getattr(draft.generation_config, k, None) for k in
             ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
    if kind == "hf-assisted":
        draft.generation_config.num_assistant_tokens = block_len
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
    if kind in ("hf-assisted", "hf-default"):
        kwargs["assistant_model"] = draft
    calls = [0]
    handle = target.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    try:
        torch.manual_seed(seed)
        _sync(pair.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(input_ids, **kwargs)
        _sync(pair.device)
        elapsed = time.perf_counter() - start
    finally:
        handle.remove()
        for k, v in saved.items():
            setattr(draft.generation_config, k, v)
    # (its prefill cannot be timed apart: end to end only)
    return {"tokens": int(out.shape[1] - input_ids.shape[1]), "seconds": None, "wall": elapsed,
            "target_calls": calls[0]}


def _recordings(pair) -> tuple[int, float, float]:
    """CUDA graphs the pair's static steps have recorded so far, the seconds spent recording them and
    the seconds of shapes' eager uses before their recording (0s where none run: the CPU)."""
    views = [tree_decoder._LEAN.get(model) for model in (pair.target, pair.draft) if model is not None]
    steps = [s for s in (getattr(view, "steps", None) for view in views) if isinstance(s, StaticSteps)]
    return (sum(s.captures for s in steps), sum(s.capture_seconds for s in steps),
            sum(s.first_use_seconds for s in steps))


def run_ours(pair, ids: list[int], method: str, k: int, length: int, max_new: int, temperature: float,
             seed: int) -> dict:
    before = _recordings(pair)
    _sync(pair.device)
    start = time.perf_counter()
    out = generate(pair, prompt_ids=ids, method=method, num_paths=max(k, 1), block_len=max(length, 1),
                   temperature=temperature, max_new_tokens=max_new, eos_token_id=[], seed=seed)
    _sync(pair.device)
    wall = time.perf_counter() - start
    s = out.stats
    return {"tokens": s.new_tokens, "seconds": s.time_total, "wall": wall, "target_calls": s.target_calls,
            "phases": s.time_draft + s.time_target, "tree_nodes": s.tree_nodes, "tree_calls": s.tree_calls,
            "arms": s.auto_arms, **dict(zip(("graphs", "recording_s", "first_uses_s"),
                                            (a - b for a, b in zip(_recordings(pair), before))))}


def _median_ms(fn, repeats: int, inner: int = 50, device="cpu") -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / inner * 1e3)
    return statistics.median(times)


def _paired_ms(first, second, rounds: int, device="cpu", inner: int = 50) -> tuple[float, float, float]:
    """Two calls timed in alternating rounds of ``inner`` calls each: the median ms of each and the
    median over the rounds of their ratio (first / second)."""
    first(), second()
    times = {first: [], second: []}
    for _ in range(rounds):
        for fn in (first, second):
            _sync(device)
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            _sync(device)
            times[fn].append((time.perf_counter() - start) / inner * 1e3)
    ratios = [a / b for a, b in zip(times[first], times[second])]
    return statistics.median(times[first]), statistics.median(times[second]), statistics.median(ratios)


def micro(pair, repeats: int) -> dict:
    """One-off per-call costs of the lean models (prefix of 128 cached tokens)."""
    # The probe tensors name their device: torch.set_default_device would install a function mode
    # that taxes every later tensor factory (it stays installed even when set back to "cpu").
    return _micro(pair, repeats, torch.device(pair.device), {})


def _recorded(fn, dev):
    """``fn``'s kernels recorded as one CUDA graph (warmed up on the recording stream); its replay."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize(dev)
        graph.capture_begin()
        fn()
        graph.capture_end()
    torch.cuda.current_stream(dev).wait_stream(stream)
    return graph.replay


def _micro(pair, repeats: int, dev, out: dict) -> dict:
    def median_ms(fn, inner: int = 50) -> float:
        return _median_ms(fn, repeats, inner, dev)

    with torch.inference_mode():
        for name, model in (("draft", pair.draft), ("target", pair.target)):
            # (the draft as decoding drafts with it: bfloat16-rounded weights where tree_decoder does so)
            lean = tree_decoder.draft_lean_model(model, pair.target) if name == "draft" else lean_model(model)
            cache = lean.new_cache(1, 512)
            prefix = 128
            lean.forward(torch.arange(prefix, device=dev)[None] % 100, torch.arange(prefix, device=dev)[None], 0, cache,
                         None, causal=True)
            one = torch.tensor([[7]], device=dev)
            pos = torch.tensor([[prefix]], device=dev)
            step = lambda: lean.forward(one, pos, prefix, cache, None)  # noqa: E731
            tree = torch.full((1, 25), 7, device=dev)
            tree_pos = prefix + torch.arange(25, device=dev)[None]
            tree_mask = torch.ones(1, 1, 25, prefix + 25, dtype=torch.bool, device=dev)
            out[f"{name}_25_nodes_ms"] = median_ms(lambda: lean.forward(tree, tree_pos, prefix, cache, tree_mask))

            # The forward's own matrix multiplies (same layout and fusion), one input row each, 2D as
            # the forward gives them (one mm call each, no views); by the panel kernel where the host
            # forward uses it (gbv/engine/host_kernels.py).
            host = lean.host_forward
            if host is not None and host.panels_off is None and torch.get_num_threads() == 1:
                panels = [product.panel for product in host.products()]
                rows = [(np.zeros((1, w.in_features), np.float32), np.zeros((1, w.out_features), np.float32))
                        for w in panels]

                def matmuls():
                    for weight, (x, y) in zip(panels, rows):
                        weight.matmul_into(x, y)

                out[f"{name}_matmuls_by"] = "panel kernel"
            else:
                inputs = {}
                for matrix in lean.matrices():
                    inputs.setdefault(matrix.in_features, torch.zeros(1, matrix.in_features, dtype=lean.dtype,
                                                                      device=dev))

                def matmuls():
                    for matrix in lean.matrices():
                        matrix(inputs[matrix.in_features])

                out[f"{name}_matmuls_by"] = "torch"
                if dev.type == "cuda":  # their device time: recorded as one graph, as the step is replayed
                    matmuls = _recorded(matmuls, dev)
                    out[f"{name}_matmuls_by"] = "torch, one CUDA graph"
            if lean.forward_times is not None:  # (which CPU forward runs, measured when the lean view was made)
                out[f"{name}_forward_choice"] = (f"{lean.forward_choice} (one-token steps measured at load: "
                                                 + ", ".join(f"{form} {ms:.2f} ms"
                                                             for form, ms in lean.forward_times.items()) + ")")
            # The step and its products timed in alternating rounds, and their ratio taken per round: a
            # change of the machine's speed between two separate medians (one figure of 1.46x in the
            # nineteenth session's bf16 table, 1.03x in the eighteenth's) then moves both alike.
            out[f"{name}_step_ms"], out[f"{name}_matmuls_ms"], out[f"{name}_step_over_matmuls"] = _paired_ms(
                step, matmuls, max(repeats, 9), dev)
        out["target_bytes"] = sum(p.numel() * p.element_size() for p in pair.target.parameters())
        big = torch.ones(64 * 1024 * 1024 // 4 * 4, dtype=torch.float32, device=dev)  # 256 MiB
        seconds = median_ms(lambda: big.sum(), inner=3) / 1e3
        out["read_bandwidth_gb_s"] = big.numel() * 4 / seconds / 1e9
    return out


def bench(args) -> dict:
    torch.set_num_threads(args.threads)
    prompts = benchmark_prompts(args.prompts)
    report = {"args": vars(args), "results": {}}
    for dtype in args.dtype.split(","):
        pair = load_pair("bundled", dtype=dtype, device=args.device)
        ids = [pair.tokenizer(p)["input_ids"] for p in prompts]
        start = time.perf_counter()
        report["results"][dtype] = {"micro": micro(pair, args.repeats), "temperatures": {}}
        if args.row_times:
            print(f"  {dtype}: micro-measurements {time.perf_counter() - start:.2f} s", file=sys.stderr)
        rows = rows_for(not args.no_hf)
        for temperature in [float(t) for t in args.temperature.split(",")]:
            totals = {label: [] for label, *_ in rows}
            generate(pair, prompt_ids=ids[0], method="gbv", num_paths=2, block_len=2, max_new_tokens=8,
                     eos_token_id=[])  # warm-up
            for seed_set in range(args.seed_sets):
                for index, prompt_ids in enumerate(ids):
                    for label, method, k, length in rows:
                        seed = index + SEED_SET_STRIDE * seed_set
                        if method.startswith("hf-"):
                            result = run_hf(pair, prompt_ids, method, length, args.max_new_tokens, temperature, seed)
                        else:
                            result = run_ours(pair, prompt_ids, method, k, length, args.max_new_tokens, temperature,
                                              seed)
                        result["seed_set"] = seed_set
                        totals[label].append(result)
                        if args.row_times:
                            print(f"    {label}: {result['wall']:.2f} s", file=sys.stderr)
                    print(f"  {dtype} T={temperature}: seed set {seed_set + 1}/{args.seed_sets}, prompt {index + 1}/"
                          f"{len(ids)}", file=sys.stderr)
            report["results"][dtype]["temperatures"][str(temperature)] = totals
    return report


# Seeds of seed set s: prompt index + s * SEED_SET_STRIDE (--seed-sets).
SEED_SET_STRIDE = 1000


def _sum(results: list[dict], key: str) -> float:
    return sum(r.get(key) or 0 for r in results)


def markdown(report: dict) -> str:
    args = report["args"]
    sets = args.get("seed_sets", 1)
    lines = [f"Command: `python scripts/bench_engine.py --prompts {args['prompts']} --max-new-tokens "
             f"{args['max_new_tokens']} --temperature {args['temperature']} --dtype {args['dtype']}"
             f"{f' --seed-sets {sets}' if sets > 1 else ''}`; "
             f"{2 * args['prompts']} prompts ({args['prompts']} GSM8K + {args['prompts']} HumanEval)"
             f"{f', each with {sets} seeds' if sets > 1 else ''}, {args['threads']} thread(s), EOS off.", ""]
    if args.get("device", "cpu") != "cpu":
        lines += [f"On {args['device']} the phase clocks are read without a synchronisation (the engine profiles "
                  "only on the CPU), so the draft+target share counts the time to launch those phases' work, "
                  "not the device's time.", ""]
    for dtype, res in report["results"].items():
        m = res["micro"]
        lines += [f"**{dtype}**: draft forward {m['draft_step_ms']:.2f} ms; target 1-token step "
                  f"{m['target_step_ms']:.2f} ms = {m.get('target_step_over_matmuls', m['target_step_ms'] / m['target_matmuls_ms']):.2f}x its matrix "
                  f"multiplies ({m['target_matmuls_ms']:.2f} ms, {m.get('target_matmuls_by', 'torch')}); 25-node tree pass = "
                  f"{m['target_25_nodes_ms'] / m['target_step_ms']:.2f}x a 1-token step; target/draft step ratio "
                  f"{m['target_step_ms'] / m['draft_step_ms']:.1f}."
                  + "".join(f" {name.capitalize()}: {m[f'{name}_forward_choice']}." for name in ("target", "draft")
                            if f"{name}_forward_choice" in m), ""]
        for temperature, totals in res["temperatures"].items():
            ar_rate = pooled_rate(totals["ar"])
            bandwidth = m["target_bytes"] * ar_rate / 1e9
            lines += [f"*{dtype}, T = {temperature}*: `ar` reads the target's {m['target_bytes'] / 1e6:.1f} MB per "
                      f"token, {bandwidth:.1f} GB/s achieved against {m['read_bandwidth_gb_s']:.1f} GB/s measured "
                      f"read bandwidth ({bandwidth / m['read_bandwidth_gb_s']:.0%}).", "",
                      "| method | tokens/s | vs ar | end to end tokens/s | vs ar | block efficiency "
                      "| tree nodes / call | draft+target share |",
                      "|---|---|---|---|---|---|---|---|"]
            fixed = [label for label in totals if is_fixed_row(label)]
            best_fixed = max(fixed, key=lambda label: pooled_rate(totals[label]))
            best_fixed_wall = max(fixed, key=lambda label: pooled_rate(totals[label], "wall"))
            ar_wall = pooled_rate(totals["ar"], "wall")
            for label, results in totals.items():
                tokens, rate, wall = _sum(results, "tokens"), pooled_rate(results), pooled_rate(results, "wall")
                calls = _sum(results, "target_calls")
                nodes = _sum(results, "tree_nodes") / _sum(results, "tree_calls") if _sum(results, "tree_calls") else 0
                share = (_sum(results, "phases") / _sum(results, "seconds") if results[0].get("phases") is not None
                         else None)
                best = " (best fixed)" if label == best_fixed else ""
                best += " (best fixed end to end)" if label == best_fixed_wall and label != best_fixed else ""
                lines.append(f"| {label}{best} | {f'{rate:.1f} | {rate / ar_rate:.2f}x' if rate else '- | -'} | "
                             f"{wall:.1f} | {wall / ar_wall:.2f}x | {tokens / calls:.2f} | "
                             f"{f'{nodes:.1f}' if nodes else '-'} | {f'{share:.0%}' if share is not None else '-'} |")
            recorded = {label: (_sum(results, "graphs"), _sum(results, "recording_s"), _sum(results, "first_uses_s"))
                        for label, results in totals.items()}
            if any(graphs or first for graphs, _, first in recorded.values()):  # (CUDA: once per process)
                lines += ["", "CUDA graphs recorded during the timed prompts, and the eager uses of shapes before "
                          "their recording (both counted in the rows' times): " + ", ".join(
                              f"{label} {graphs:.0f} in {seconds * 1e3:.0f} ms + {first * 1e3:.0f} ms"
                              for label, (graphs, seconds, first) in recorded.items() if graphs or first) + "."]
            arms: dict[str, int] = {}
            for r in totals["auto"]:
                for arm, count in (r.get("arms") or {}).items():
                    arms[arm] = arms.get(arm, 0) + count
            top = sorted(arms.items(), key=lambda kv: -kv[1])[:3]
            peers = [label for label in totals if label.startswith("hf")]
            auto_wall = pooled_rate(totals["auto"], "wall")
            auto_rate = pooled_rate(totals["auto"])
            lines += ["", f"`auto` = {auto_rate / pooled_rate(totals[best_fixed]):.3f}x the best fixed row "
                      f"({best_fixed}), {auto_wall / pooled_rate(totals[best_fixed_wall], 'wall'):.3f}x end to end "
                      f"({best_fixed_wall})"
                      + "".join(f"; {auto_wall / pooled_rate(totals[peer], 'wall'):.1f}x {peer}" for peer in peers)
                      + f" end to end; its most chosen arms: {', '.join(f'{a} ({n})' for a, n in top)}.", ""]
            # (the maximum over a dozen rows on the same prompts is partly the luckiest: held_out_best)
            held_out, chosen = held_out_best(totals, fixed)
            lines += [f"The best fixed row chosen on the other half of the prompts (held out: {chosen[0]} for the "
                      f"even-numbered prompts, {chosen[1]} for the odd ones) makes {held_out / ar_rate:.2f}x `ar`; "
                      f"`auto` makes {auto_rate / held_out:.3f}x it.", ""]
            sets = sorted({r.get("seed_set", 0) for r in totals["auto"]})
            if len(sets) > 1:  # each seed set alone: how much of a row's rate is its texts' luck
                def rate_in(label: str, seed_set: int) -> float:
                    return pooled_rate([r for r in totals[label] if r.get("seed_set", 0) == seed_set])

                cells = []
                for seed_set in sets:
                    fixed = {label: rate_in(label, seed_set) for label in totals if is_fixed_row(label)}
                    best = max(fixed, key=fixed.get)
                    cells.append(f"set {seed_set}: {best} {fixed[best] / rate_in('ar', seed_set):.2f}x `ar`, `auto` "
                                 f"{rate_in('auto', seed_set) / fixed[best]:.3f}x it, {best_fixed} "
                                 f"{fixed[best_fixed] / rate_in('ar', seed_set):.2f}x `ar`")
                lines += [f"Each seed set alone (seeds = prompt index + {SEED_SET_STRIDE} x set): "
                          + "; ".join(cells) + ".", ""]
        lines += [f"*{dtype}: the goals of the engine-speed issue* (`gbv.bench.engine_goals`):", "",
                  goals_markdown(engine_goals(m, res["temperatures"], args.get("device", "cpu"))), ""]
    return "\n".join(lines)


def goals_of(paths: list[str]) -> str:
    """The goals table of each dtype of saved runs (``--out``'s FILE.json), older files' included; with more
    than one, then all of them side by side (met or not)."""
    parts, columns = [], []
    common = os.path.commonpath([os.path.dirname(os.path.abspath(path)) for path in paths])
    for path in paths:
        try:
            with open(path) as f:
                report = json.load(f)
            results = report["results"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"bench_engine.py: cannot read a saved run from {path!r} ({exc}); give the FILE.json that --out "
                  "wrote", file=sys.stderr)
            raise SystemExit(2) from None
        for dtype, res in results.items():
            goals = engine_goals(res["micro"], res["temperatures"], report.get("args", {}).get("device", "cpu"))
            parts += [f"{path}, {dtype}:", "", goals_markdown(goals), ""]
            name = os.path.relpath(os.path.abspath(path), common).removesuffix(".json").removesuffix(".md")
            columns.append((f"{name} ({dtype})", goals))
    if len(columns) > 1:
        parts += ["Side by side:", "", goals_matrix_markdown(columns), ""]
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20, help="prompts per data set (GSM8K and HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", default="0.2,1.0")
    parser.add_argument("--dtype", default="float32", help="comma-separated, e.g. float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each micro-measurement")
    parser.add_argument("--row-times", action="store_true",
                        help="print each row's seconds per prompt to stderr (to find a slow row on a new device)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    parser.add_argument("--seed-sets", type=int, default=1,
                        help="run every prompt with this many seeds (prompt index + 1000 x set): a fixed row's rate "
                             "depends on the texts its seeds draw (a few %% here), and the best of a dozen rows on one "
                             "set of texts is partly the luckiest")
    parser.add_argument("--out", default=None, help="write the markdown table here (and FILE.json)")
    parser.add_argument("--goals-of", nargs="+", metavar="FILE.json", default=None,
                        help="run nothing: print the goals table of saved runs (the FILE.json of --out)")
    args = parser.parse_args()
    if args.goals_of:
        print(goals_of(args.goals_of))
        return 0
    report = bench(args)
    text = markdown(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
