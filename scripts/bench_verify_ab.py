"""Before/after of a verifier (BV, token-level, GBV, gbv-adaptive or SpecTr) in one process: the verifier,
``gbv/verify/ranking.py``, ``gbv/verify/block.py`` and the compiled helpers as of a git revision against
the working tree, on the same instances and seeds.

    python scripts/bench_verify_ab.py --before HEAD~1 --method gbv --vocab 32768 --instances 40
    python scripts/bench_verify_ab.py --before HEAD~1 --method gbv-adaptive --vocab 4096 --paths 3
    python scripts/bench_verify_ab.py --before HEAD~1 --method gbv --engine   # in the engine, bundled pair
    python scripts/bench_verify_ab.py --before HEAD~1 --method block --paths 1 --block-len 4 --engine --dtype bfloat16
    python scripts/bench_verify_ab.py --capture /tmp/inputs.pt --method gbv-adaptive --paths 3
    python scripts/bench_verify_ab.py --before HEAD~1 --method gbv-adaptive --inputs /tmp/inputs.pt

Instances are ``scripts/bench_verifiers.py``'s (seeds 0 .. N-1). Each instance runs three rounds,
before and after alternating in order, each call with a fresh ``TorchRandom`` seeded by the instance;
the first round is a warm-up. Prints the median time per call of each side, their ratio, and on how
many instances the two sides returned the same (path, accepted length, next token): a change meant
to be exact must show all of them.

``--engine``: the method in the engine instead (K = ``--paths``, L = ``--block-len``), on ``--prompts``
GSM8K + HumanEval prompts each, the two sides per prompt in alternating order (the engine looks the
verifier up when it makes a decoder, so the module attribute is swapped), T = 0.2 and 1, 96 new
tokens: tokens/s, verify milliseconds per iteration, and the share of the forwards in the wall time.

``--capture FILE``: record the verifier's inputs ``(draft_tokens, q, p)`` in the engine instead (the
same prompts and temperatures, 64 new tokens), for ``--inputs FILE``: the before/after timing on those
engine instances (real rows: sharp at T = 0.2, flat at T = 1) instead of random ones.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import types

import torch

import gbv.verify.block as block_after
import gbv.verify.gbv as gbv_after
import gbv.verify.token as token_after
import gbv.verify.gbv_adaptive as adaptive_after
import gbv.verify.spectr as spectr_after
from gbv.verify import TorchRandom, common

from bench_engine_ab import load_before  # scripts/ is on the path when run as a script
from bench_verifiers import make_inputs

MODULES = {"block": ("gbv/verify/block.py", block_after, "verify_block"),
           "token": ("gbv/verify/token.py", token_after, "verify_token"),
           "gbv": ("gbv/verify/gbv.py", gbv_after, "verify_gbv"),
           "gbv-adaptive": ("gbv/verify/gbv_adaptive.py", adaptive_after, "verify_gbv_adaptive"),
           "spectr": ("gbv/verify/spectr.py", spectr_after, "verify_spectr")}


def kernels_before(rev: str) -> types.ModuleType | None:
    """``gbv/verify/_verify_kernels.c`` as of ``rev``, compiled as setup.py compiles it (into a temporary
    folder) and imported under another name; None where ``rev`` has no such file or no compiler runs.
    Why: the 'before' side must run its own compiled helpers, not the working tree's."""
    try:
        source = subprocess.run(["git", "show", f"{rev}:gbv/verify/_verify_kernels.c"], capture_output=True,
                                text=True, check=True).stdout
    except subprocess.CalledProcessError:
        return None
    folder = tempfile.mkdtemp(prefix="kernels_before_")
    c_file, so_file = os.path.join(folder, "_verify_kernels.c"), os.path.join(folder, "_verify_kernels.so")
    with open(c_file, "w") as handle:
        handle.write(source)
    compiler = sysconfig.get_config_var("CC") or "cc"
    command = [*compiler.split(), "-O2", "-ffp-contract=off", "-fPIC", "-shared",
               f"-I{sysconfig.get_paths()['include']}", c_file, "-o", so_file]
    if subprocess.run(command, capture_output=True).returncode != 0:
        return None
    spec = importlib.util.spec_from_file_location("kernels_before._verify_kernels", so_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_verifier_before(rev: str, method: str):
    """``method``'s verify function as of ``rev``, importing the ranking and block modules of ``rev`` too
    (the verifier calls ``block_verify_core``, whose callbacks may differ between revisions), and with
    ``rev``'s compiled helpers (:func:`kernels_before`) behind the 'before' modules' ``common``."""
    common_before = types.ModuleType("common_before")
    common_before.__dict__.update(common.__dict__)
    common_before.compiled_kernels = kernels_before(rev) if common.compiled_kernels is not None else None
    sys.modules["common_before"] = common_before
    uses_common = {"from gbv.verify import common, ranking":
                   "import common_before as common, ranking_before as ranking",
                   "from gbv.verify import common": "import common_before as common"}
    load_before(rev, "gbv/verify/ranking.py", "ranking_before", uses_common)
    load_before(rev, "gbv/verify/block.py", "block_before", uses_common)
    path, _, function = MODULES[method]
    module = load_before(rev, path, f"{method.replace('-', '_')}_before",
                         {"from gbv.verify.ranking import": "from ranking_before import",
                          "from gbv.verify.block import": "from block_before import", **uses_common})
    print(f"before = {rev}, with {'its' if common_before.compiled_kernels is not None else 'no'} compiled helpers")
    return getattr(module, function)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="git revision of the 'before' side (required unless --capture)")
    parser.add_argument("--method", choices=sorted(MODULES), default="gbv")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--paths", type=int, default=4)
    parser.add_argument("--block-len", type=int, default=8)
    parser.add_argument("--instances", type=int, default=30)
    parser.add_argument("--engine", action="store_true", help="in the engine on the bundled pair instead")
    parser.add_argument("--prompts", type=int, default=8, help="--engine / --capture: prompts per data set")
    parser.add_argument("--capture", metavar="FILE", help="save the verifier's inputs in the engine to FILE")
    parser.add_argument("--dtype", default=None,
                        help="--engine / --capture: the bundled pair's dtype (default: its own)")
    parser.add_argument("--inputs", metavar="FILE", help="time on inputs saved by --capture")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.capture:
        capture(args.method, args.paths, args.block_len, args.prompts, args.capture, args.dtype)
        return
    if not args.before:
        parser.error("--before is required (unless --capture)")
    sides = {"before": load_verifier_before(args.before, args.method),
             "after": getattr(MODULES[args.method][1], MODULES[args.method][2])}
    if args.engine:
        engine_ab(args.method, args.paths, args.block_len, args.prompts, sides, args.dtype)
        return
    times: dict[str, list[float]] = {"before": [], "after": []}
    same = 0
    saved = torch.load(args.inputs) if args.inputs else None
    count = len(saved) if saved is not None else args.instances
    for seed in range(count):
        inputs = saved[seed] if saved is not None else make_inputs(args.vocab, args.paths, args.block_len, seed)
        results = {}
        for round_ in range(3):
            for name in (("before", "after") if round_ % 2 == 0 else ("after", "before")):
                rng = TorchRandom(torch.Generator().manual_seed(seed))
                start = time.perf_counter()
                result = sides[name](*inputs, rng)
                elapsed = time.perf_counter() - start
                if round_ > 0:
                    times[name].append(elapsed)
                results[name] = (result.path, result.accepted_len, int(result.next_token))
        same += results["before"] == results["after"]
    before, after = statistics.median(times["before"]), statistics.median(times["after"])
    where = (f"{args.inputs} ({count} engine instances)" if saved is not None
             else f"V={args.vocab} K={args.paths} L={args.block_len}")
    print(f"{args.method} {where}: before {before * 1e3:.2f} ms, after {after * 1e3:.2f} ms, "
          f"after/before {after / before:.3f}; identical results on {same}/{count} instances")


def capture(method: str, num_paths: int, block_len: int, prompts_per_set: int, path: str,
            dtype: str | None = None) -> None:
    """Record ``method``'s inputs in the engine on the bundled pair (``prompts_per_set`` GSM8K +
    HumanEval prompts, T = 0.2 and 1, 64 new tokens) and save them to ``path``."""
    import gbv
    from gbv.data import load_prompts

    module, function = MODULES[method][1], MODULES[method][2]
    original = getattr(module, function)
    saved = []

    def recording(draft_tokens, q, p, rng):
        saved.append((draft_tokens.clone(), q.clone(), p.clone()))
        return original(draft_tokens, q, p, rng)

    pair = gbv.load_pair("bundled", dtype=dtype)
    prompts = load_prompts("gsm8k")[:prompts_per_set] + load_prompts("humaneval")[:prompts_per_set]
    setattr(module, function, recording)
    try:
        for temperature in (0.2, 1.0):
            for i, prompt in enumerate(prompts):
                gbv.generate(pair, prompt=prompt, method=method, num_paths=num_paths, block_len=block_len,
                             temperature=temperature, max_new_tokens=64, eos_token_id=[], seed=i)
    finally:
        setattr(module, function, original)
    torch.save(saved, path)
    print(f"saved {len(saved)} inputs of {method} K={num_paths} L={block_len} to {path}")


def engine_ab(method: str, num_paths: int, block_len: int, prompts_per_set: int, sides: dict,
              dtype: str | None = None) -> None:
    """Two verify functions of ``method`` (``sides``: name -> function) in the engine on the bundled
    pair: ``prompts_per_set`` GSM8K + HumanEval prompts, both sides per prompt in alternating order,
    T = 0.2 and 1, 96 new tokens. The engine looks the verifier up when it makes a decoder, so the
    module attribute is swapped (and put back afterwards). Prints tokens/s, verify milliseconds per
    iteration and the forwards' share of the wall time, per side. Also used by bench_device_forms.py."""
    import gbv
    from gbv.data import load_prompts

    module, function = MODULES[method][1], MODULES[method][2]
    original = getattr(module, function)
    names = list(sides)
    pair = gbv.load_pair("bundled", dtype=dtype)
    prompts = load_prompts("gsm8k")[:prompts_per_set] + load_prompts("humaneval")[:prompts_per_set]
    print(f"| {method} K={num_paths} L={block_len} {dtype or ''}, T | side | tokens/s | verify ms / iteration | "
          "forwards share |\n|---|---|---:|---:|---:|")
    try:
        for temperature in (0.2, 1.0):
            totals = {name: [0, 0.0, 0.0, 0.0, 0] for name in names}
            for i, prompt in enumerate(prompts):
                for name in (names if i % 2 == 0 else names[::-1]):
                    setattr(module, function, sides[name])
                    stats = gbv.generate(pair, prompt=prompt, method=method, num_paths=num_paths,
                                         block_len=block_len, temperature=temperature, max_new_tokens=96,
                                         eos_token_id=[], seed=i).stats.to_dict()
                    row = totals[name]
                    row[0] += stats["new_tokens"]
                    row[1] += stats["time_total"]
                    row[2] += stats["time_verify"]
                    row[3] += stats["time_draft"] + stats["time_target"]
                    row[4] += stats["target_calls"]
            for name, (tokens, total, verify, forwards, calls) in totals.items():
                print(f"| {temperature} | {name} | {tokens / total:.1f} | {verify / calls * 1e3:.2f} | "
                      f"{forwards / total:.1%} |", flush=True)
    finally:
        setattr(module, function, original)


if __name__ == "__main__":
    main()
