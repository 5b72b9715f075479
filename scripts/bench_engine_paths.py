"""Before/after in one run: the plain HF path (GBV_ENGINE=hf, the engine before issue 8) vs the tree engine.

    python scripts/bench_engine_paths.py      # bundled pair, 5 GSM8K + 5 HumanEval prompts, 128 tokens, T = 1, 1 thread
"""
import os, torch, gbv
from prompt_sets import benchmark_prompts
torch.set_num_threads(1)
pair = gbv.load_pair("bundled")
prompts = benchmark_prompts(5)
rows = [("ar", 1, 1), ("block", 1, 4), ("gbv", 3, 8)]
tot = {}
gbv.generate(pair, prompt=prompts[0], method="block", block_len=2, max_new_tokens=8, eos_token_id=[])
for i, p in enumerate(prompts):
    for engine in ("hf", "tree"):
        os.environ["GBV_ENGINE"] = engine
        for m, k, l in rows:
            o = gbv.generate(pair, prompt=p, method=m, num_paths=k, block_len=l, temperature=1.0, max_new_tokens=128, eos_token_id=[], seed=i)
            t = tot.setdefault((engine, m), [0, 0.0])
            t[0] += o.stats.new_tokens; t[1] += o.stats.time_total
for engine in ("hf", "tree"):
    ar = tot[(engine, "ar")][0] / tot[(engine, "ar")][1]
    print(engine, {m: f"{tot[(engine,m)][0]/tot[(engine,m)][1]:.1f} tok/s ({tot[(engine,m)][0]/tot[(engine,m)][1]/ar:.2f}x ar)" for m, _, _ in rows})
print("tree ar / hf ar:", f"{(tot[('tree','ar')][0]/tot[('tree','ar')][1]) / (tot[('hf','ar')][0]/tot[('hf','ar')][1]):.2f}x")
