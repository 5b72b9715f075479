"""Before/after in one run (1 thread, bundled pair): the engine's lean forward, its sampler and the
block-verification core of the multi-path verifiers as of an earlier commit, against the working
tree, interleaved per prompt.

    python scripts/bench_engine_ab.py --before db6bd01              # 10 GSM8K + 10 HumanEval prompts, ~8 min
    python scripts/bench_engine_ab.py --before db6bd01 --prompts 3  # a quick look

"Before" is ``gbv/engine/lean.py``, ``TreeDecoder.step`` and the drafting it calls (one iteration of
the tree engine),
``gbv.verify.common.draw_rows`` (the inverse-CDF draw every sampling step uses) and
``gbv.verify.block.block_verify_core`` (the last step of GBV and gbv-adaptive) and the single-path
verifiers ``verify_block`` and ``verify_token`` loaded from
``git show REV:...`` under other names; each variant's lean views are swapped into the engine's
cache of them, and its functions into the classes and modules that call them. Everything else is
the working tree's. Use it for changes to those places.

1. Forwards of the lean draft and target over a 128-token prefix: 1 new token, and a 25-node pass.
2. The engine: tokens/s of ``ar``, ``block`` L=4 and L=8 and ``gbv`` K=3 L=8 with each variant.
Medians over repeats; the machine is shared, so only ratios within this run mean anything.
"""
import argparse
import inspect
import subprocess
import sys
import types

import torch

import gbv
import gbv.engine.sampling as sampling
import gbv.engine.tree_decoder as tree_decoder
import gbv.verify.block as block
import gbv.verify.common as common
import gbv.verify.gbv as gbv_module
import gbv.verify.gbv_adaptive as gbv_adaptive
import gbv.verify.token as token

from bench_engine import _median_ms  # scripts/ is on the path when run as a script
from prompt_sets import benchmark_prompts


def load_before(rev: str, path: str, name: str, replace: dict[str, str] | None = None) -> types.ModuleType:
    """The module at ``path`` as of commit ``rev``, imported as ``name`` (after replacing each key of
    ``replace`` by its value in the source: to import another 'before' module instead of ours)."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
    for old, new in (replace or {}).items():
        source = source.replace(old, new)
    module = types.ModuleType(name)
    sys.modules[name] = module  # before exec: dataclasses look their module up
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision of the 'before' variant")
    parser.add_argument("--prompts", type=int, default=10, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    # (before static steps, new_cache took no owner: the working tree's decoders pass one)
    lean_before = load_before(args.before, "gbv/engine/lean.py", "lean_before",
                              {"def new_cache(self, batch: int, capacity: int) ->":
                               "def new_cache(self, batch: int, capacity: int, owner=None) ->"})
    draw_before = load_before(args.before, "gbv/verify/common.py", "common_before").draw_rows
    draw_after = common.draw_rows
    block_before = load_before(args.before, "gbv/verify/block.py", "block_before")
    core_before, core_after = block_before.block_verify_core, block.block_verify_core
    if "residual_bounds" not in inspect.signature(core_before).parameters:
        # Before the residual masses came as bounds (seventh session), the core took a list of exact
        # masses: today's verifiers cannot call that core, so both sides run the working tree's.
        print(f"note: block_verify_core of {args.before} takes exact residual masses; the working tree's core "
              "runs on both sides", file=sys.stderr)
        core_before = core_after
    # The single-path verifiers as the engine calls them (it looks them up when a decoder is made).
    single_before = {"block": block_before.verify_block,
                     "token": load_before(args.before, "gbv/verify/token.py", "token_before").verify_token}
    single_after = {"block": block.verify_block, "token": token.verify_token}
    # One iteration's methods (step and what it calls: their signatures change between revisions).
    iteration = ("step", "_draft_paths", "_draft_one_path", "_target_step")
    class_before = load_before(args.before, "gbv/engine/tree_decoder.py", "tree_decoder_before").TreeDecoder
    methods = {"before": {name: class_before.__dict__[name] for name in iteration if name in class_before.__dict__},
               "after": {name: tree_decoder.TreeDecoder.__dict__[name] for name in iteration
                         if name in tree_decoder.TreeDecoder.__dict__}}
    pair = gbv.load_pair("bundled", dtype=args.dtype)
    models = (pair.target, pair.draft)
    views = {"before": {m: lean_before.LeanCausalLM(m) for m in models},
             "after": {m: tree_decoder.LeanCausalLM(m) for m in models}}

    def use(variant: str) -> None:
        for model, lean in views[variant].items():
            tree_decoder._LEAN[model] = lean
        common.draw_rows = sampling.draw_rows = draw_before if variant == "before" else draw_after
        gbv_module.block_verify_core = gbv_adaptive.block_verify_core = (core_before if variant == "before"
                                                                         else core_after)
        for name in iteration:
            if name in methods[variant]:
                setattr(tree_decoder.TreeDecoder, name, methods[variant][name])
            elif name in tree_decoder.TreeDecoder.__dict__:
                delattr(tree_decoder.TreeDecoder, name)
        single = single_before if variant == "before" else single_after
        block.verify_block, token.verify_token = single["block"], single["token"]

    with torch.inference_mode():
        print("| forward | before ms | after ms | before/after |\n|---|---:|---:|---:|")
        prefix = 128
        for label, model in (("draft", pair.draft), ("target", pair.target)):
            for nodes in (1, 25):
                times = {}
                for _ in range(5):
                    for variant in ("before", "after"):
                        lean = views[variant][model]
                        cache = lean.new_cache(1, 512)
                        lean.forward(torch.arange(prefix)[None] % 100, torch.arange(prefix)[None], 0, cache, None,
                                     causal=True)
                        tokens = torch.full((1, nodes), 7)
                        positions = prefix + torch.arange(nodes)[None]
                        mask = torch.ones(1, 1, nodes, prefix + nodes, dtype=torch.bool) if nodes > 1 else None
                        # One token as the engine's 1-token steps run it (causal, no mask given).
                        times.setdefault(variant, []).append(_median_ms(
                            lambda: lean.forward(tokens, positions, prefix, cache, mask, causal=nodes == 1), 5,
                            20 if nodes == 1 else 5))
                before, after = (sorted(times[v])[len(times[v]) // 2] for v in ("before", "after"))
                print(f"| {label}, {nodes} token{'s' if nodes > 1 else ''} | {before:.3f} | {after:.3f} | "
                      f"{before / after:.3f}x |")

    prompts = benchmark_prompts(args.prompts)
    ids = [pair.tokenizer(p)["input_ids"] for p in prompts]
    rows = [("ar", 1, 1), ("block", 1, 4), ("block", 1, 8), ("gbv", 3, 8)]
    for variant in ("before", "after"):  # warm-up
        use(variant)
        gbv.generate(pair, prompt_ids=ids[0], method="block", block_len=4, max_new_tokens=8, eos_token_id=[])
    print("\nms/iteration: wall time per target call, what a change of the random stream leaves alone (the texts,\n"
          "and so the block efficiency, follow the stream; tokens/s follows both)")
    print(f"\n| method | T | before tok/s | after tok/s | after/before | before ms/it | after ms/it | after/before "
          f"| block efficiency before / after |\n|---|---|---:|---:|---:|---:|---:|---:|---|")
    for temperature in (0.2, 1.0):
        totals = {}
        for seed, prompt_ids in enumerate(ids):
            for variant in (("before", "after") if seed % 2 == 0 else ("after", "before")):  # (drift hits both)
                use(variant)
                for method, k, length in rows:
                    out = gbv.generate(pair, prompt_ids=prompt_ids, method=method, num_paths=k, block_len=length,
                                       temperature=temperature, max_new_tokens=args.max_new_tokens,
                                       eos_token_id=[], seed=seed)
                    tokens, seconds, calls = totals.get((method, length, variant), (0, 0.0, 0))
                    totals[(method, length, variant)] = (tokens + out.stats.new_tokens,
                                                         seconds + out.stats.time_total,
                                                         calls + out.stats.target_calls)
        for method, k, length in rows:
            (tok_b, sec_b, it_b), (tok_a, sec_a, it_a) = (totals[(method, length, v)] for v in ("before", "after"))
            before, after = tok_b / sec_b, tok_a / sec_a
            ms_b, ms_a = 1e3 * sec_b / it_b, 1e3 * sec_a / it_a
            label = "ar" if method == "ar" else f"{method} K={k} L={length}"
            print(f"| {label} | {temperature} | {before:.1f} | {after:.1f} | {after / before:.3f}x | {ms_b:.3f} | "
                  f"{ms_a:.3f} | {ms_a / ms_b:.3f}x | {tok_b / it_b:.2f} / {tok_a / it_a:.2f} |")
    use("after")


if __name__ == "__main__":
    main()
