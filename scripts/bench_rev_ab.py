"""Before/after of any change, in separate processes: a git revision's whole package against the
working tree's, on the bundled pair (1 thread), in alternating rounds.

    python scripts/bench_rev_ab.py --before HEAD                        # the working tree against HEAD
    python scripts/bench_rev_ab.py --before f1c41a5 --rows ar,block:4,auto --rounds 8
    python scripts/bench_rev_ab.py --before HEAD --dtype bfloat16 --temperature 1.0 --prompts 5
    python scripts/bench_rev_ab.py --before HEAD --family gptneox    # the bundled shapes as a random GPT-NeoX pair

Why separate processes: the in-process A/B scripts (``bench_engine_ab.py``, ``bench_auto_ab.py``) load
a few old modules beside the new ones, which breaks as soon as a signature between them changes. Here
"before" is a ``git worktree`` of ``--before`` (made under ``--worktrees``, its compiled kernels
built there), imported through ``PYTHONPATH``; "after" is this checkout. Each round runs one worker
process per variant, in alternating order (before first in odd rounds), and each worker loads the
pair, warms up on one prompt, then runs every row over the same prompts (GSM8K and HumanEval, seeds
0.., EOS off, ``--max-new-tokens``), rows interleaved per prompt. Reported per row: the median over
rounds of after/before tokens/s (each round's ratio from its pooled tokens/s), their range, and the
pooled tokens/s of each variant. A worker only calls the public API (``gbv.load_pair``,
``gbv.generate`` and its ``stats``), so any revision with it can serve as "before".

Also reported: each variant's block efficiency (new tokens per target call) and the median ratio of
seconds per target call. A change that moves the logits by rounding samples other texts from the same
seeds, whose acceptance differs in every round alike; the time per call compares the costs apart from it.

Rows: ``ar``, ``auto``, ``METHOD:L`` (one path, e.g. ``block:4``) or ``METHOD:K:L`` (``gbv:3:8``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_row(row: str) -> dict:
    """``ar`` / ``auto`` / ``METHOD:L`` / ``METHOD:K:L`` -> generate's settings."""
    parts = row.split(":")
    if parts[0] in ("ar", "auto") and len(parts) == 1:
        return {"method": parts[0]}
    if len(parts) == 2 and parts[1].isdigit():
        return {"method": parts[0], "num_paths": 1, "block_len": int(parts[1])}
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return {"method": parts[0], "num_paths": int(parts[1]), "block_len": int(parts[2])}
    raise SystemExit(f"bench_rev_ab: bad row {row!r}; use ar, auto, METHOD:L or METHOD:K:L (e.g. block:4, gbv:3:8)")


def worker(args) -> None:
    """One variant's run (the gbv on PYTHONPATH): prints {row: [tokens, seconds]} as JSON."""
    import time

    import torch

    import gbv
    from prompt_sets import benchmark_prompts

    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", dtype=args.dtype)
    if args.family != "llama":  # (the random or rewritten pair of a family, as bench_architectures.py runs)
        sys.path.insert(0, str(REPO / "tests" / "engine"))
        from engine_toy import family_models
        from gbv.models.loading import ModelPair

        target, draft = family_models(pair.target, pair.draft, args.family)
        pair = ModelPair(target.to(pair.target.dtype), draft.to(pair.draft.dtype), tokenizer=pair.tokenizer)
    prompts = benchmark_prompts(args.prompts)
    rows = args.rows.split(",")
    settings = {row: parse_row(row) for row in rows}
    totals = {}
    for temperature in [float(t) for t in args.temperature.split(",")]:
        common = dict(temperature=temperature, eos_token_id=[])
        for row in rows:  # warm-up (auto's policy sees these few tokens before the timed prompts)
            gbv.generate(pair, prompt=prompts[0], max_new_tokens=16, **common, **settings[row])
        for seed, prompt in enumerate(prompts):
            for row in (rows if seed % 2 == 0 else rows[::-1]):
                start = time.perf_counter()
                out = gbv.generate(pair, prompt=prompt, max_new_tokens=args.max_new_tokens, seed=seed, **common,
                                   **settings[row])
                spent = time.perf_counter() - start
                tokens, seconds, calls = totals.setdefault(f"{row} T={temperature}", [0, 0.0, 0])
                totals[f"{row} T={temperature}"] = [tokens + len(out.token_ids), seconds + spent,
                                                    calls + out.stats.to_dict()["target_calls"]]
    print(json.dumps({"gbv": gbv.__file__, "totals": totals}))


def worktree(rev: str, root: Path) -> Path:
    """A worktree of ``rev`` under ``root`` with its compiled kernels built (reused if present)."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True)
    if commit.returncode != 0:
        raise SystemExit(f"bench_rev_ab: {rev!r} is not a commit of this repository")
    path = root / f"gbv-{commit.stdout.strip()[:12]}"
    if not (path / "gbv").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(path), commit.stdout.strip()],
                       check=True, capture_output=True)
    if (path / "setup.py").exists():
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=path, check=True,
                       capture_output=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="git revision of the 'before' variant (required unless --worker)")
    parser.add_argument("--rows", default="ar,block:4,gbv:3:8,auto")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per data set and round (default 3)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of one process per variant (default 6)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", default="0.2,1.0")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--worktrees", default="/tmp/gbv-ab", help="where the 'before' worktree goes")
    parser.add_argument("--family", default="llama",
                        help="the bundled pair (llama, the default) or its pair in another family's layout, as "
                             "scripts/bench_architectures.py --families names them (e.g. gptneox, gpt2, phi)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for row in args.rows.split(","):
        parse_row(row)
    if args.worker:
        return worker(args)
    if not args.before:
        parser.error("--before REV is required")
    trees = {"before": worktree(args.before, Path(args.worktrees)), "after": REPO}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rows", args.rows, "--prompts",
               str(args.prompts), "--max-new-tokens", str(args.max_new_tokens), "--temperature", args.temperature,
               "--dtype", args.dtype, "--family", args.family]
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        for variant in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(trees[variant]),
                                                                             os.environ.get("PYTHONPATH")])))
            done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=trees[variant])
            if done.returncode != 0:
                raise SystemExit(f"bench_rev_ab: the {variant} worker failed:\n{done.stderr[-2000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if not result["gbv"].startswith(str(trees[variant])):
                raise SystemExit(f"bench_rev_ab: the {variant} worker imported {result['gbv']}, not its tree")
            runs[variant].append(result["totals"])
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    print(f"`{args.before}` (before) against the working tree (after), {args.family} pair, {args.dtype}, 1 thread, "
          f"{args.rounds} rounds "
          f"x {2 * args.prompts} prompts x {args.max_new_tokens} tokens\n")
    print("| row | before tokens/s | after tokens/s | after / before (median) | range over rounds "
          "| after / before, each against its process's ar (median) | block efficiency, before / after "
          "| seconds per target call, after / before (median) |")
    print("|---|---:|---:|---:|---|---:|---|---:|")

    def speed(totals: dict, row: str) -> float:
        return totals[row][0] / totals[row][1]

    for row in runs["after"][0]:
        rate = {v: sum(r[row][0] for r in runs[v]) / sum(r[row][1] for r in runs[v]) for v in runs}
        pairs = list(zip(runs["after"], runs["before"]))
        ratios = sorted(speed(a, row) / speed(b, row) for a, b in pairs)
        # Whole processes run at different speeds (the same code varied by +-30% between rounds here):
        # against the same process's ar row at the same temperature, that factor cancels.
        ar = "ar T=" + row.split(" T=")[1]
        relative = "-"
        if ar in runs["after"][0] and row != ar:
            relative = f"{statistics.median(speed(a, row) / speed(a, ar) / (speed(b, row) / speed(b, ar)) for a, b in pairs):.3f}"
        # A change that moves the logits by rounding changes which texts are sampled, so the two variants
        # may keep different numbers of tokens per call on the same prompts and seeds, in every round
        # alike: the time per target call (an iteration) compares their costs apart from that.
        efficiency = {v: runs[v][0][row][0] / runs[v][0][row][2] for v in runs}
        per_call = statistics.median((a[row][1] / a[row][2]) / (b[row][1] / b[row][2]) for a, b in pairs)
        print(f"| {row} | {rate['before']:.1f} | {rate['after']:.1f} | {statistics.median(ratios):.3f} | "
              f"{ratios[0]:.3f}-{ratios[-1]:.3f} | {relative} | {efficiency['before']:.2f} / "
              f"{efficiency['after']:.2f} | {per_call:.3f} |")


if __name__ == "__main__":
    main()
