"""Before/after in one run (1 thread, bundled pair): ``auto`` with a setting of its policy off and on,
each variant with its own policy learning over the same prompts, interleaved per prompt with plain
``ar`` and BV rows (``--blocks``, default L = 2). Rates are end to end (each generate call's wall time).

    python scripts/bench_auto_ab.py                                   # aging of the estimates (auto._AGE)
    python scripts/bench_auto_ab.py --switch depth-prior              # the depth prior of the acceptance
    python scripts/bench_auto_ab.py --dtype bfloat16 --prompts 20     # 20 GSM8K + 20 HumanEval (default)

``--switch age``: "before" is ``auto._AGE = 1`` (estimates do not age), "after" the current value.
``--switch depth-prior``: "before" is ``auto._PRIOR_DEPTH_TRIALS = 1e-9`` (the rule before the prior).
``--switch stretch``: "before" is ``auto._STRETCH = 1`` (ar tried and recorded one step at a time).
``--switch horizon``: "before" is ``auto._HORIZON = 16`` (switching costs spread over 16 tokens).
``--switch settle``: "before" is ``auto._SWITCH_IN_STRETCHES = 1`` (an ar switch-in runs one stretch).
``--switch tail``: "before" is ``auto._TAIL_UNRECORDED = False`` (ar's steps at a generation's end recorded).
``--before REV``: "before" is ``gbv/engine/auto.py`` as of git revision REV (loaded beside the
installed one; its policies its own), "after" the working tree's (``--switch`` is then ignored):

    python scripts/bench_auto_ab.py --before HEAD --dtype bfloat16
"""
import argparse
import subprocess
import sys
import time
import types

import torch

import gbv
from gbv.engine import auto
from prompt_sets import benchmark_prompts

SWITCHES = {"age": ("_AGE", 1.0), "depth-prior": ("_PRIOR_DEPTH_TRIALS", 1e-9), "stretch": ("_STRETCH", 1),
            "horizon": ("_HORIZON", 16.0), "settle": ("_SWITCH_IN_STRETCHES", 1),
            "tail": ("_TAIL_UNRECORDED", False)}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--switch", choices=sorted(SWITCHES), default="age")
parser.add_argument("--dtype", default="float32")
parser.add_argument("--prompts", type=int, default=20, help="GSM8K and HumanEval prompts each")
parser.add_argument("--temperature", default="0.2,1.0")
parser.add_argument("--before", help="a git revision: its auto.py against the working tree's")
parser.add_argument("--blocks", default="2", help="BV block lengths of the fixed rows (default 2), e.g. 3,4,6,8")
args = parser.parse_args()
name, off = SWITCHES[args.switch]
variants = {"before": off, "after": getattr(auto, name)}
modules = {"before": auto, "after": auto}
if args.before:
    source = subprocess.run(["git", "show", f"{args.before}:gbv/engine/auto.py"], capture_output=True, text=True,
                            check=True).stdout
    old = types.ModuleType("gbv.engine.auto_before")
    sys.modules[old.__name__] = old  # (dataclasses look their module up)
    exec(compile(source, f"gbv/engine/auto.py@{args.before}", "exec"), old.__dict__)
    modules["before"] = old
    name, variants = None, {"before": None, "after": None}

torch.set_num_threads(1)
pair = gbv.load_pair("bundled", dtype=args.dtype)
prompts = benchmark_prompts(args.prompts)
gbv.generate(pair, prompt=prompts[0], method="block", block_len=2, max_new_tokens=8, eos_token_id=[])
if name is None:
    print(f"`auto` of {args.before} (before) and of the working tree (after), {args.dtype}\n")
else:
    print(f"`auto` with auto.{name} = {variants['before']} (before) and {variants['after']} (after), {args.dtype}\n")
blocks = [int(b) for b in args.blocks.split(",")]
print("| T | ar tok/s | " + " | ".join(f"BV L={b} / ar" for b in blocks)
      + " | auto before / ar | auto after / ar | after / before | before / best BV | after / best BV |")
print("|---|---:|" + "---:|" * (len(blocks) + 5))
for temperature in [float(t) for t in args.temperature.split(",")]:
    stores = {variant: {} for variant in variants}  # each variant's own policies (auto keys them per target)
    rows = ["ar", *(f"block{b}" for b in blocks), *variants]
    totals = {row: [0, 0.0] for row in rows}
    for seed, prompt in enumerate(prompts):
        for row in (rows if seed % 2 == 0 else rows[::-1]):
            if row in variants:
                gbv.engine.auto = modules[row]  # (what make_decoder imports)
                if name is not None:
                    setattr(auto, name, variants[row])
                    auto._POLICIES[pair.target] = stores[row]
            method = "ar" if row == "ar" else "block" if row.startswith("block") else "auto"
            block_len = int(row[5:]) if method == "block" else 2
            start = time.perf_counter()  # (end to end: the prefill, and auto's later feed of the draft's prompt)
            out = gbv.generate(pair, prompt=prompt, method=method, block_len=block_len, num_paths=1, temperature=temperature,
                               max_new_tokens=128, eos_token_id=[], seed=seed)
            totals[row][0] += out.stats.new_tokens
            totals[row][1] += time.perf_counter() - start
    rate = {row: t / s for row, (t, s) in totals.items()}
    best = max(rate[f"block{b}"] for b in blocks)
    print(f"| {temperature} | {rate['ar']:.1f} | " + " | ".join(f"{rate[f'block{b}'] / rate['ar']:.3f}x" for b in blocks)
          + f" | {rate['before'] / rate['ar']:.3f}x | {rate['after'] / rate['ar']:.3f}x | "
          f"{rate['after'] / rate['before']:.3f} | {rate['before'] / best:.3f} | {rate['after'] / best:.3f} |", flush=True)
gbv.engine.auto = auto
if name is not None:
    setattr(auto, name, variants["after"])
