"""``gbv bench``: block efficiency and tokens/s over datasets, methods, K, L and temperature.

    gbv bench --dataset gsm8k --prompts 10 --methods ar,block,gbv,hf-assisted --num-paths 1,2,3,4 \\
              --block-len 4,8 --temperature 0.2,1.0 --max-new-tokens 64 --out results/run1
    gbv bench --exact --vocab 3 --block-len 2 --num-paths 1,2,3 --instances 20 --out results/exact

Outputs in ``--out``: ``results.jsonl`` (one line per prompt and setting), ``summary.csv``,
``summary.md``, PNG plots and ``meta.json``. Every argument is checked before a model loads or a
file is written; a bad one is a one-line error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from gbv.bench import grid
from gbv.errors import GbvError

DEFAULTS = {  # methods default to every registered one (grid.all_methods / grid.exact_methods)
    "bench": {"num_paths": "1,2,3,4", "block_len": "4,8"},
    "exact": {"num_paths": "1,2,3", "block_len": "2"},
}


class _MethodsHelp(str):
    """The --methods help, listing the registry only when help is shown (the registry imports torch)."""

    def __mod__(self, params):
        return (f"comma-separated, from {','.join(grid.all_methods())} (default: all; with --exact: "
                f"{','.join(grid.exact_methods())})")


def _progress_label(dataset: str, index: int, setting: grid.Setting) -> str:
    """``gsm8k #3 gbv K=2 L=8 T=1``; methods without a draft show no K or L."""
    drafted = "" if setting.method in grid.NO_DRAFT else f" K={setting.num_paths} L={setting.block_len}"
    return f"{dataset} #{index} {setting.method}{drafted} T={setting.temperature:g}"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="measure block efficiency and tokens/s over methods, K, L, temperature",
        description="Sweep datasets x methods x K x L x temperature on a target/draft pair (or, with --exact, "
                    "compute the same tables exactly on random tiny instances) and write results.jsonl, "
                    "summary.csv, summary.md and plots to --out.")
    p.add_argument("--target", default=None, help="target model (local dir or cached hub id); default: bundled pair")
    p.add_argument("--draft", default=None, help="draft model (with --target)")
    p.add_argument("--dataset", default=",".join(grid.DATASETS),
                   help=f"comma-separated, from {','.join(grid.DATASETS)} (default: all)")
    p.add_argument("--prompts", type=int, default=10, help="prompts per dataset (first N)")
    p.add_argument("--methods", default=None, help=_MethodsHelp("methods"))
    p.add_argument("--num-paths", default=None,
                   help=f"K values, 1 to {grid.MAX_NUM_PATHS}, e.g. 1,2,3,4 (default 1,2,3,4; --exact: 1,2,3)")
    p.add_argument("--block-len", default=None,
                   help=f"L values, 1 to {grid.MAX_BLOCK_LEN}, e.g. 4,8 (default 4,8; --exact: 2)")
    p.add_argument("--temperature", default="0.2,0.6,1.0", help="temperatures, e.g. 0.2,0.6,1.0")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--seed", type=int, default=0, help="base seed (per-prompt seeds derive from it; default 0)")
    p.add_argument("--out", required=True,
                   help="output folder (created); one that holds results needs --resume or --overwrite")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out: keep its results, run only the missing ones (same command)")
    p.add_argument("--overwrite", action="store_true", help="delete the results in --out first")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default=None, help="model dtype, e.g. float32, bfloat16 (default: checkpoint's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 for models up to 100M parameters, else torch's)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop starting new prompts after this many minutes and summarise the complete ones")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--merge", default=None, metavar="DIR,DIR",
                   help="no run: one report (summary, plots) from the results.jsonl of earlier runs")
    g = p.add_argument_group("exact mode (no models)")
    g.add_argument("--exact", action="store_true", help="exact tables on random synthetic instances")
    g.add_argument("--vocab", type=int, default=3, help="vocabulary size of the instances (default 3)")
    g.add_argument("--instances", type=int, default=20, help="random instances per setting (default 20)")
    g.add_argument("--logit-scale", type=float, default=2.0, help="std of the target logits (default 2)")
    g.add_argument("--draft-noise", type=float, default=1.0,
                   help="std of the noise added to the target logits to get the draft's (default 1)")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------- validation
def _validate(args: argparse.Namespace) -> dict:
    mode = "exact" if args.exact else "bench"
    methods_allowed = grid.exact_methods() if args.exact else grid.all_methods()
    cfg: dict = {"mode": mode}
    cfg["methods"] = grid.parse_names(args.methods or ",".join(methods_allowed), "methods", methods_allowed)
    cfg["num_paths"] = sorted(grid.parse_ints(args.num_paths or DEFAULTS[mode]["num_paths"], "num-paths",
                                              1, grid.MAX_NUM_PATHS))
    cfg["block_len"] = sorted(grid.parse_ints(args.block_len or DEFAULTS[mode]["block_len"], "block-len",
                                              1, grid.MAX_BLOCK_LEN))
    cfg["temperature"] = sorted(grid.parse_temperatures(args.temperature))
    if args.seed is None or args.seed < 0:
        raise GbvError(f"--seed must be a non-negative integer, got {args.seed}")
    if args.threads is not None:
        grid.positive_int(args.threads, "threads", 256)
    if args.exact:
        from gbv.bench.exact import check_exact_sizes

        if args.resume:
            raise GbvError("--resume applies to model benchmarks; an --exact run is recomputed: use --overwrite")
        check_exact_sizes(args.vocab, cfg["block_len"], cfg["num_paths"], args.instances)
        if not (args.logit_scale > 0) or not (args.draft_noise >= 0):
            raise GbvError("--logit-scale must be > 0 and --draft-noise >= 0")
    else:
        cfg["datasets"] = grid.parse_names(args.dataset, "dataset", grid.DATASETS)
        grid.positive_int(args.prompts, "prompts", 100_000)
        grid.positive_int(args.max_new_tokens, "max-new-tokens", 100_000)
        if args.max_minutes is not None and not args.max_minutes > 0:
            raise GbvError(f"--max-minutes must be positive, got {args.max_minutes}")
        needs_draft = any(m not in grid.NO_DRAFT for m in cfg["methods"])
        if args.draft is not None and args.target is None:
            raise GbvError("--draft needs --target (or give neither, for the bundled pair)")
        if args.target not in (None, "bundled") and args.draft is None and needs_draft:
            raise GbvError("--target needs --draft for the chosen methods (only ar and hf-ar run without one)")
    grid.check_methods_available(cfg["methods"])
    cfg["out"] = grid.check_out_dir(args.out, args.resume, args.overwrite)
    return cfg


def _command(args: argparse.Namespace, cfg: dict) -> str:
    """The canonical command line that reproduces this run."""
    parts = ["gbv", "bench"]
    if cfg["mode"] == "exact":
        parts += ["--exact", "--vocab", str(args.vocab)]
    elif args.target is not None:
        parts += ["--target", args.target, "--draft", args.draft]
    if cfg["mode"] == "bench":
        parts += ["--dataset", ",".join(cfg["datasets"]), "--prompts", str(args.prompts)]
    parts += ["--methods", ",".join(cfg["methods"]), "--num-paths", ",".join(map(str, cfg["num_paths"])),
              "--block-len", ",".join(map(str, cfg["block_len"])),
              "--temperature", ",".join(f"{t:g}" for t in cfg["temperature"])]
    if cfg["mode"] == "bench":
        parts += ["--max-new-tokens", str(args.max_new_tokens)]
        if args.max_minutes is not None:
            parts += ["--max-minutes", f"{args.max_minutes:g}"]
        if args.device != "cpu":
            parts += ["--device", args.device]
        if args.dtype:
            parts += ["--dtype", args.dtype]
    else:
        parts += ["--instances", str(args.instances)]
        if args.logit_scale != 2.0:
            parts += ["--logit-scale", f"{args.logit_scale:g}"]
        if args.draft_noise != 1.0:
            parts += ["--draft-noise", f"{args.draft_noise:g}"]
    parts += ["--seed", str(args.seed)]
    if args.threads:
        parts += ["--threads", str(args.threads)]
    parts += ["--out", str(args.out)]
    return shlex.join(parts)


def _progress(total: int, disabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=disabled, dynamic_ncols=True, mininterval=1.0)


def _meta(cfg: dict, command: str, started: float, extra: dict) -> dict:
    import torch

    meta = {"command": command, "mode": cfg["mode"],
            "started_utc": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
            "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(time.time() - started, 1), "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    meta.update(extra)
    return meta


# ---------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    if args.merge:
        return _run_merge(args)
    cfg = _validate(args)
    command = _command(args, cfg)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if cfg["mode"] == "exact":
        return _run_exact(args, cfg, command)
    return _run_models(args, cfg, command)


def _write_outputs(out: Path, rows: list[dict], csv_columns: tuple[str, ...], markdown: str) -> None:
    from gbv.atomic import atomic_write_text
    from gbv.bench.report import to_csv

    atomic_write_text(out / "summary.csv", to_csv(rows, csv_columns))
    atomic_write_text(out / "summary.md", markdown)


def _run_exact(args: argparse.Namespace, cfg: dict, command: str) -> int:
    from gbv.bench import exact, plots
    from gbv.atomic import atomic_write_text
    from gbv.bench.report import JsonlWriter

    started = time.time()
    total = exact.count_exact_jobs(cfg["block_len"], cfg["num_paths"], cfg["temperature"], cfg["methods"],
                                   args.instances)
    with _progress(total, args.no_progress, "exact") as bar:
        records = exact.exact_records(args.vocab, cfg["block_len"], cfg["num_paths"], cfg["temperature"],
                                      cfg["methods"], args.instances, args.seed, args.logit_scale,
                                      args.draft_noise, progress=bar.update)
    out: Path = cfg["out"]
    out.mkdir(parents=True, exist_ok=True)
    grid.clear_outputs(out)
    writer = JsonlWriter(out / "results.jsonl")
    for rec in records:
        writer.write(rec)
    writer.close()
    rows = exact.summarize_exact(records, cfg["methods"])
    description = (f"Instances: target logits ~ N(0, {args.logit_scale:g}^2) per context, draft logits = target "
                   f"logits + N(0, {args.draft_noise:g}^2) noise; both divided by T and softmaxed (T = 0: argmax). "
                   f"The same {args.instances} instances (seed {args.seed}) at every T.")
    _write_outputs(out, rows, exact.EXACT_COLUMNS, exact.exact_markdown(rows, command, description))
    multi = [m for m in cfg["methods"] if not grid.is_single_path(m)] + ["lp"]
    flat = [m for m in cfg["methods"] if grid.is_single_path(m)]
    plots.plot_vs_k(rows, "expected_accepted", "accepted length E[tau]", out / "accepted_vs_K.png",
                    ("V", "L", "T"), ("V", "L", "T"), multi, flat, "Exact expected accepted length vs K")
    if len(cfg["temperature"]) > 1:  # one temperature would draw an empty plot
        plots.plot_vs_temperature(rows, "expected_accepted", "accepted length E[tau]",
                                  out / "accepted_vs_temperature.png", ("V", "L"), ("V", "L"),
                                  cfg["methods"] + ["lp"], "Exact expected accepted length vs temperature")
    atomic_write_text(out / "meta.json", json.dumps(_meta(cfg, command, started, {
        "vocab": args.vocab, "instances": args.instances, "logit_scale": args.logit_scale,
        "draft_noise": args.draft_noise}), indent=1) + "\n")
    print(f"wrote {len(records)} exact results and {len(rows)} summary rows to {out}", file=sys.stderr)
    return 0


def _run_models(args: argparse.Namespace, cfg: dict, command: str) -> int:
    import gbv
    from gbv.bench import runner
    from gbv.atomic import atomic_write_text
    from gbv.bench.report import JsonlWriter

    started = time.time()
    runner.quiet_transformers()
    settings = grid.expand_settings(cfg["methods"], cfg["num_paths"], cfg["block_len"], cfg["temperature"])
    needs_draft = any(s.method not in grid.NO_DRAFT for s in settings)
    if args.target is None or args.target == "bundled":
        pair = gbv.load_pair("bundled", device=args.device, dtype=args.dtype)
    else:
        pair = gbv.load_pair(target=args.target, draft=args.draft, device=args.device, dtype=args.dtype)
    if needs_draft and pair.draft is None:
        raise GbvError("the chosen methods need a draft model (--draft)")
    if pair.tokenizer is None:
        raise GbvError("the model pair has no tokenizer; the benchmark needs one to encode prompts")
    if not args.threads:
        from gbv.engine.threads import apply_threads

        apply_threads(None, pair.target, pair.draft)
    prompts = {d: runner.load_dataset_prompts(d, args.prompts, pair.tokenizer) for d in cfg["datasets"]}
    eos = runner.eos_id(pair)
    seeds = {(d, p.index): runner.prompt_seed(args.seed, d_idx, p.index)
             for d_idx, d in enumerate(cfg["datasets"]) for p in prompts[d]}

    out: Path = cfg["out"]
    done = _resumable(out, settings, seeds, args.max_new_tokens) if args.resume else {}
    out.mkdir(parents=True, exist_ok=True)
    grid.clear_outputs(out, keep=RESULT_SOURCES if args.resume else ())
    first = next(iter(prompts.values()))[0]
    runner.warm_up(pair, first, settings, eos)
    total = sum(len(p) for p in prompts.values()) * len(settings)
    writer = JsonlWriter(out / "results.jsonl")
    for record in done.values():  # first, so that a crash now loses nothing of the earlier run
        writer.write(record)
    # Prompt index outer, dataset inner: a run stopped early (--max-minutes, Ctrl-C, SIGTERM) has about
    # as many prompts for every dataset, and the same prompts for every method: only prompts that ran
    # every setting are summarised.
    budget_s = None if args.max_minutes is None else 60.0 * args.max_minutes
    stopped = ""
    # Ctrl-C and SIGTERM in the loop stop it and summarise the complete prompts (gbv.cli exits at once
    # on Ctrl-C elsewhere).
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with _progress(total, args.no_progress, "bench") as bar:
            for index in range(max(len(p) for p in prompts.values())):
                for dataset in cfg["datasets"]:
                    if index >= len(prompts[dataset]):
                        continue
                    if budget_s is not None and index > 0 and time.time() - started > budget_s:
                        stopped = f"time budget of {args.max_minutes:g} min reached"
                        raise _BudgetReached
                    prompt = prompts[dataset][index]
                    seed = seeds[(dataset, prompt.index)]
                    for setting in settings:
                        bar.set_postfix_str(_progress_label(dataset, prompt.index, setting), refresh=False)
                        if (dataset, prompt.index, *setting.key()) not in done:
                            writer.write(runner.run_one(pair, prompt, setting, args.max_new_tokens, seed, eos))
                        bar.update(1)
    except _BudgetReached:
        pass
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        writer.close()
    records = _complete_prompts(writer.records, len(settings))
    if stopped:
        print(f"gbv bench: {stopped}; summarising {len(records)} results of complete prompts", file=sys.stderr)
    if not records:
        raise GbvError(f"no prompt completed every setting ({stopped or 'no results'}); nothing to summarise")
    names = pair.names
    title = f"Benchmark: {names[0]} (target) / {names[1]} (draft)"
    if stopped:
        title += f" (stopped early: {stopped})"
    rows = write_model_report(out, records, title, command)
    atomic_write_text(out / "meta.json", json.dumps(_meta(cfg, command, started, {
        "stopped_early": stopped or None,
        "prompts_completed": {d: len({r["prompt_index"] for r in records if r["dataset"] == d})
                              for d in cfg["datasets"]},
        "target": names[0], "draft": names[1], "resumed": bool(done),
        "device": str(pair.device), "datasets": cfg["datasets"],
        "prompts": args.prompts, "max_new_tokens": args.max_new_tokens}), indent=1) + "\n")
    print(f"wrote {len(records)} results and {len(rows)} summary rows to {out}", file=sys.stderr)
    return 130 if stopped == "interrupted" else 0


def write_model_report(out: Path, records: list[dict], title: str, command: str | list[str]) -> list[dict]:
    """summary.csv, summary.md and the three plots of a model benchmark; returns the summary rows."""
    from gbv.bench import plots
    from gbv.bench.report import POOLED, SUMMARY_COLUMNS, summarize, summary_markdown

    order = list(grid.all_methods())
    rows = summarize(records, order)
    _write_outputs(out, rows, SUMMARY_COLUMNS, summary_markdown(rows, title, command))
    present = [m for m in order if any(r["method"] == m for r in rows)]
    present += sorted({r["method"] for r in rows} - set(present))  # merged runs of since-removed methods
    multi = [m for m in present if not grid.is_single_path(m) and m not in grid.NO_DRAFT]
    single = [m for m in present if grid.is_single_path(m)]
    no_draft = [m for m in present if m in grid.NO_DRAFT]
    plots.plot_vs_k(rows, "block_efficiency", "block efficiency (tokens / target call)",
                    out / "block_efficiency_vs_K.png", ("dataset", "L", "T"), ("", "L", "T"), multi, single,
                    "Block efficiency vs number of draft paths K")
    pooled = [r for r in rows if r["dataset"] == POOLED] or rows
    plots.plot_vs_k(pooled, "tokens_per_s", "tokens/s", out / "tokens_per_s_vs_K.png", ("dataset", "L", "T"),
                    ("", "L", "T"), multi, single + no_draft,
                    "Tokens per second vs K" + (" (all datasets pooled)" if pooled is not rows else ""))
    if len({r["T"] for r in rows}) > 1:  # one temperature would draw an empty plot
        plots.plot_vs_temperature(rows, "block_efficiency", "block efficiency (tokens / target call)",
                                  out / "block_efficiency_vs_temperature.png", ("dataset", "L"), ("", "L"),
                                  multi + single, "Block efficiency vs temperature")
    return rows


def _run_merge(args: argparse.Namespace) -> int:
    """``--merge A,B``: one report from earlier runs (e.g. split by temperature), over the prompts that
    are complete in every run; nothing is re-run."""
    from gbv.atomic import atomic_write_text
    from gbv.bench.report import JsonlWriter, read_jsonl

    sources = [Path(d) for d in grid.parse_list(args.merge, "merge", str)]
    for src in sources:
        if not (src / "results.jsonl").is_file():
            raise GbvError(f"--merge: {str(src)!r} has no results.jsonl (not a finished gbv bench folder)")
    if args.resume:
        raise GbvError("--resume does not apply to --merge (it runs nothing); use --overwrite")
    out = grid.check_out_dir(args.out, overwrite=args.overwrite)
    if any(src.resolve() == out.resolve() for src in sources):
        raise GbvError("--merge: --out must differ from the merged folders")
    started = time.time()
    per_source, metas = [], []
    for src in sources:
        records = read_jsonl(src / "results.jsonl")
        counts: dict[tuple, int] = {}
        for rec in records:
            counts[(rec["dataset"], rec["prompt_index"])] = counts.get((rec["dataset"], rec["prompt_index"]), 0) + 1
        full = max(counts.values(), default=0)
        per_source.append([r for r in records if counts[(r["dataset"], r["prompt_index"])] == full])
        meta_path = src / "meta.json"
        metas.append(json.loads(meta_path.read_text()) if meta_path.is_file() else {})
    common = set.intersection(*({(r["dataset"], r["prompt_index"]) for r in recs} for recs in per_source))
    records = [r for recs in per_source for r in recs if (r["dataset"], r["prompt_index"]) in common]
    if not records:
        raise GbvError("--merge: no prompt is complete in every merged run")
    out.mkdir(parents=True, exist_ok=True)
    grid.clear_outputs(out)
    writer = JsonlWriter(out / "results.jsonl")
    for rec in records:
        writer.write(rec)
    writer.close()
    command = shlex.join(["gbv", "bench", "--merge", args.merge, "--out", str(args.out)])
    target, draft = metas[0].get("target"), metas[0].get("draft")
    title = f"Benchmark: {target} (target) / {draft} (draft)" if target else "Benchmark"
    rows = write_model_report(out, records, title, [m.get("command", "?") for m in metas] + [command])
    atomic_write_text(out / "meta.json", json.dumps({
        "command": command, "merged": [m.get("command") for m in metas], "target": target, "draft": draft,
        "prompts_completed": {d: len({i for (dd, i) in common if dd == d}) for d in sorted({d for d, _ in common})},
        "stopped_early": [m.get("stopped_early") for m in metas],
        "created_utc": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds")}, indent=1) + "\n")
    print(f"merged {len(records)} results into {len(rows)} summary rows in {out}", file=sys.stderr)
    return 0


class _BudgetReached(Exception):
    pass


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _complete_prompts(records: list[dict], num_settings: int) -> list[dict]:
    """Only the (dataset, prompt) groups that ran every setting (a stopped run keeps comparisons fair)."""
    counts: dict[tuple, int] = {}
    for rec in records:
        key = (rec["dataset"], rec["prompt_index"])
        counts[key] = counts.get(key, 0) + 1
    return [r for r in records if counts[(r["dataset"], r["prompt_index"])] == num_settings]


RESULT_SOURCES = ("results.jsonl", ".results.jsonl.partial")


def _resumable(out: Path, settings: list[grid.Setting], seeds: dict[tuple, int], max_new_tokens: int
               ) -> dict[tuple, dict]:
    """``--resume``: the records of the run in ``out`` by (dataset, prompt, method, K, L, T). The
    partial file of an interrupted run is newer than a finished results.jsonl; a line cut off by a
    crash is dropped. Records this command would not produce (other grid, seed or token budget)
    are an error: resuming must never mix two configurations."""
    source = next((out / name for name in reversed(RESULT_SOURCES) if (out / name).is_file()), None)
    if source is None:
        return {}
    lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines) - 1:
                raise GbvError(f"--resume: line {number + 1} of {source} is not JSON; use --overwrite") from None
    keys = {s.key() for s in settings}
    done: dict[tuple, dict] = {}
    for rec in records:
        key = (rec["dataset"], rec["prompt_index"], rec["method"], rec["K"], rec["L"], rec["T"])
        if key[2:] not in keys or seeds.get(key[:2]) != rec["seed"] or rec["max_new_tokens"] != max_new_tokens:
            raise GbvError(f"--resume: {source.name} in --out holds a result this command would not produce "
                           f"({key[0]} #{key[1]} {key[2]} K={key[3]} L={key[4]} T={key[5]:g}, seed {rec['seed']}, "
                           f"max-new-tokens {rec['max_new_tokens']}); rerun the original command or use --overwrite")
        done[key] = rec
    return done

