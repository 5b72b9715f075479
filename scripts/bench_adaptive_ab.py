"""Before/after in one run (1 thread, bundled pair): gbv-adaptive as of commit 506b865 (a full sort of
every node's row for its weight) against the current sort-free form, interleaved per prompt.

    python scripts/bench_adaptive_ab.py            # 10 GSM8K + 10 HumanEval prompts, 128 tokens, ~6 min

The "before" verifier is the module's source at that commit, loaded under another name (it only
uses helpers that still exist), and registered in place of the current one for its rows.
"""

import torch

import gbv
import gbv.verify as registry

from bench_engine_ab import load_before  # scripts/ is on the path when run as a script
from prompt_sets import benchmark_prompts

BEFORE = "506b865"
load_before(BEFORE, "gbv/verify/gbv_adaptive.py", "gbv_adaptive_before")
current = registry._REGISTRY["gbv-adaptive"]


def use(before: bool) -> None:
    registry._REGISTRY["gbv-adaptive"] = ("gbv_adaptive_before", "verify_gbv_adaptive", True) if before else current


torch.set_num_threads(1)
pair = gbv.load_pair("bundled")
prompts = benchmark_prompts(10)
rows = [(3, 4), (3, 8)]
gbv.generate(pair, prompt=prompts[0], method="gbv-adaptive", num_paths=2, block_len=2, max_new_tokens=8, eos_token_id=[])
rate = {}
for temperature in (0.2, 1.0):
    for i, prompt in enumerate(prompts):
        for before in (True, False):
            use(before)
            for k, length in rows:
                out = gbv.generate(pair, prompt=prompt, method="gbv-adaptive", num_paths=k, block_len=length,
                                   temperature=temperature, max_new_tokens=128, eos_token_id=[], seed=i)
                s = out.stats
                rate.setdefault((temperature, k, length, before), []).append((s.new_tokens, s.time_total, s.target_calls))
use(False)
print("| gbv-adaptive | T | before tok/s | after tok/s | after/before | block eff. before / after |")
print("|---|---|---:|---:|---:|---:|")
for temperature in (0.2, 1.0):
    for k, length in rows:
        b, a = rate[(temperature, k, length, True)], rate[(temperature, k, length, False)]
        rb = sum(x[0] for x in b) / sum(x[1] for x in b)
        ra = sum(x[0] for x in a) / sum(x[1] for x in a)
        eb = sum(x[0] for x in b) / sum(x[2] for x in b)
        ea = sum(x[0] for x in a) / sum(x[2] for x in a)
        print(f"| K={k} L={length} | {temperature} | {rb:.1f} | {ra:.1f} | {ra / rb:.3f} | {eb:.2f} / {ea:.2f} |")
