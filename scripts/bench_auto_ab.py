"""Before/after in one run (1 thread, bundled pair): ``auto`` without and with the depth prior of its
acceptance estimates (``gbv.engine.auto._PRIOR_DEPTH_TRIALS``; 1e-9 is the rule before it), each with
its own policy learning over the same prompts, interleaved per prompt with plain ``ar``.

    python scripts/bench_auto_ab.py            # 20 GSM8K + 20 HumanEval prompts, 128 tokens, T = 0.2 and 1
"""
import torch

import gbv
from gbv.data import load_prompts
from gbv.engine import auto

VARIANTS = {"before (no depth prior)": 1e-9, "after (depth prior 4)": auto._PRIOR_DEPTH_TRIALS}

torch.set_num_threads(1)
pair = gbv.load_pair("bundled")
prompts = load_prompts("gsm8k", 20) + load_prompts("humaneval", 20)
gbv.generate(pair, prompt=prompts[0], method="block", block_len=2, max_new_tokens=8, eos_token_id=[])
print("| T | ar tok/s | auto before tok/s | auto after tok/s | before / ar | after / ar | after / before |")
print("|---|---:|---:|---:|---:|---:|---:|")
for temperature in (0.2, 1.0):
    stores = {name: {} for name in VARIANTS}  # each variant's own policies (auto keys them per target)
    totals = {name: [0, 0.0] for name in ["ar", *VARIANTS]}
    for seed, prompt in enumerate(prompts):
        for name in ["ar", *VARIANTS]:
            if name != "ar":
                auto._PRIOR_DEPTH_TRIALS = VARIANTS[name]
                auto._POLICIES[pair.target] = stores[name]
            out = gbv.generate(pair, prompt=prompt, method="ar" if name == "ar" else "auto", temperature=temperature,
                               max_new_tokens=128, eos_token_id=[], seed=seed)
            totals[name][0] += out.stats.new_tokens
            totals[name][1] += out.stats.time_total
    rate = {name: t / s for name, (t, s) in totals.items()}
    before, after = (rate[name] for name in VARIANTS)
    print(f"| {temperature} | {rate['ar']:.1f} | {before:.1f} | {after:.1f} | {before / rate['ar']:.2f}x | "
          f"{after / rate['ar']:.2f}x | {after / before:.3f} |")
auto._PRIOR_DEPTH_TRIALS = VARIANTS["after (depth prior 4)"]
