"""What a pair of each Llama-shaped family gets: the lean tree engine against the plain Hugging Face path
(the engine these families ran on before the thirty-seventh session) and transformers' own generation,
in one process.

The pairs are the bundled pair rewritten in each family's layout (tests/engine/engine_toy.py,
``as_family``: Phi-3's fused matrices, Granite's multipliers, Gemma's norm offsets and scaled
embedding), computing the same function, bit for bit here, so every family keeps the bundled pair's
acceptance and only the engine differs. (Gemma keeps the bundled SiLU; its GELU is not measured.)
``mistral`` is the bundled weights attending within a sliding window of 128 positions (the prompts and
their 128 new tokens pass it): the same function up to there, on the torch forward (no compiled kernels
for windows). ``gemma2`` and ``gemma3`` (not in the default list) are the Gemma layout with windows of
128 on alternate layers and norms after each block: another function, so their speculative rows depend
on how well their drafts agree (the table's last column), and only ``ar`` compares engines alone:

    python scripts/bench_architectures.py --families llama,gemma2,gemma3

``gptneox``, ``gpt2``, ``opt``, ``gpt-bigcode``, ``starcoder2``, ``phi``, ``olmo`` (``olmo-clip``: with OLMo 1.7's
``clip_qkv``), ``olmo2``, ``olmo3`` and ``gptj``
(``SHAPED_LIKE`` in engine_toy.py; not in the default list) cannot compute the bundled function at all
(LayerNorms, MLPs without a gate, norms after the blocks only): their pairs are random models of the
bundled target's and draft's shapes (seeded; ``shaped_like``; StarCoder2 and OLMo 3 with windows of
128). Again only ``ar`` compares engines alone; the speculative rows run the same pair on both engines
and the peer, with whatever agreement random models have:

    python scripts/bench_architectures.py --families llama,gptneox,gpt2,opt,gpt-bigcode,starcoder2,phi
    python scripts/bench_architectures.py --families llama,olmo,olmo2,olmo3
    python scripts/bench_architectures.py --families llama,gptj

    python scripts/bench_architectures.py --out docs/results/engine/architectures-thirtyseventh.json

Rows per family: ``ar``, ``block`` L = 4 and ``auto`` on the tree engine and on the Hugging Face path
(``GBV_ENGINE=hf``), ``hf-assisted L=4`` and ``hf-plain``; each round runs every row over the same
prompts and seeds, rows and families interleaved; tokens/s are medians over rounds (1 thread).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "engine"))

from bench_engine import run_hf, run_ours  # noqa: E402
from engine_toy import family_models  # noqa: E402

import gbv  # noqa: E402
from gbv.engine.decoder import engine_for  # noqa: E402
from gbv.models.loading import ModelPair  # noqa: E402
from prompt_sets import benchmark_prompts

# (label, engine or peer, method, K, L)
ROWS = [("ar", "tree", "ar", 1, 1), ("block L=4", "tree", "block", 1, 4), ("auto", "tree", "auto", 0, 0),
        ("ar", "hf", "ar", 1, 1), ("block L=4", "hf", "block", 1, 4), ("auto", "hf", "auto", 0, 0),
        ("hf-assisted L=4", "peer", "hf-assisted", 0, 4), ("hf-plain", "peer", "hf-plain", 0, 0)]


def family_pair(bundled, family: str) -> ModelPair:
    if family == "llama":
        return bundled
    return ModelPair(*family_models(bundled.target, bundled.draft, family), tokenizer=bundled.tokenizer)


def run_row(pair, row, ids, max_new: int, temperature: float, seed: int) -> dict:
    _, engine, method, k, length = row
    if engine == "peer":
        return run_hf(pair, ids, method, length, max_new, temperature, seed)
    saved = os.environ.get("GBV_ENGINE")
    os.environ["GBV_ENGINE"] = "hf" if engine == "hf" else ""
    try:
        return run_ours(pair, ids, method, k, length, max_new, temperature, seed)
    finally:
        if saved is None:
            os.environ.pop("GBV_ENGINE", None)
        else:
            os.environ["GBV_ENGINE"] = saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="llama,phi3,granite,gemma,mistral")
    parser.add_argument("--prompts", type=int, default=5, help="GSM8K and HumanEval prompts each")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", default="1.0,0.2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GBV_AUTO_CACHE", "0")  # (auto learns in each run, as a fresh process does)
    bundled = gbv.load_pair("bundled")
    texts = benchmark_prompts(args.prompts)
    ids = [bundled.tokenizer(text)["input_ids"] for text in texts]
    families = args.families.split(",")
    pairs = {family: family_pair(bundled, family) for family in families}
    for family, pair in pairs.items():
        assert engine_for(pair.target, pair.draft) == "tree", family
        gbv.generate(pair, prompt_ids=ids[0], method="block", block_len=2, max_new_tokens=8, eos_token_id=[])
    report = {"args": vars(args), "torch": torch.__version__, "results": {}}
    for temperature in [float(t) for t in args.temperature.split(",")]:
        rates = {(family, row[0], row[1]): [] for family in families for row in ROWS}
        per_call = {family: [0, 0] for family in families}  # BV L = 4 on the tree engine: tokens, target calls
        for round_index in range(args.rounds):
            for family in families:
                for row in ROWS:
                    tokens = seconds = 0.0
                    for index, prompt in enumerate(ids):
                        result = run_row(pairs[family], row, prompt, args.max_new_tokens, temperature,
                                         index + 1000 * round_index)
                        tokens += result["tokens"]
                        seconds += result["seconds"]
                        if row[:2] == ("block L=4", "tree"):
                            per_call[family][0] += result["tokens"]
                            per_call[family][1] += result["target_calls"]
                    rates[(family, row[0], row[1])].append(tokens / seconds)
            print(f"T={temperature}: round {round_index + 1}/{args.rounds} done at {time.strftime('%H:%M:%S')}",
                  file=sys.stderr)
        report["results"][str(temperature)] = {" | ".join(key): values for key, values in rates.items()}
        print(f"\nT = {temperature}, tokens/s (median of {args.rounds} rounds; 1 thread; "
              f"{len(ids)} prompts x {args.max_new_tokens} tokens)\n")
        print("| family | ar tree | ar HF path | tree / HF path (ar) | BV L=4 tree / HF path | auto tree / HF path "
              "| auto tree vs hf-assisted L=4 | auto tree vs hf-plain | BV L=4 tokens per target call |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for family in families:
            median = {(label, engine): statistics.median(rates[(family, label, engine)]) for label, engine, *_ in ROWS}
            print(f"| {family} | {median[('ar', 'tree')]:.0f} | {median[('ar', 'hf')]:.0f} "
                  f"| {median[('ar', 'tree')] / median[('ar', 'hf')]:.2f}x "
                  f"| {median[('block L=4', 'tree')] / median[('block L=4', 'hf')]:.2f}x "
                  f"| {median[('auto', 'tree')] / median[('auto', 'hf')]:.2f}x "
                  f"| {median[('auto', 'tree')] / median[('hf-assisted L=4', 'peer')]:.2f}x "
                  f"| {median[('auto', 'tree')] / median[('hf-plain', 'peer')]:.2f}x "
                  f"| {per_call[family][0] / max(per_call[family][1], 1):.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
