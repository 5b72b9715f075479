"""CUDA graphs (gbv/engine/static_steps.py) against the eager lean forward, in one process, bundled pair.

    python scripts/bench_cuda_graphs.py                    # on a GPU: float32, 2 + 2 prompts, 128 tokens
    python scripts/bench_cuda_graphs.py --device cpu       # a dry run: static steps without capture

1. One step of each bundled model after a 64-token prefix (1 query; 25 tree nodes for the target): eager
   against replayed, and the target's matrix multiplies alone, recorded as one graph (their time
   without launch overhead: the floor of a step), so the step's multiple of them; the bandwidth the
   1-token step achieves (weight bytes / step time).
2. Whole generations in three forms, alternating per prompt (drift hits them alike): eager; a graph per
   forward with the rest launched step by step (``GBV_STATIC_ITERATION=0``); and the default, where an
   iteration's drafting is one graph, each target step records its law and draw too
   (gbv/engine/static_sampling.py) and the commit's cache moves are one graph (``StaticMove``).
   Pooled tokens/s of each row, the ratios, and each row against ``ar`` with graphs.
3. The graphs recorded and the seconds spent recording them (first uses; a server pays them once).
4. Where a speculative iteration's time goes, graphs on, in both forms of 2: the
   decoders' draft / target / verify phase clocks, synchronised (the engine itself reads them
   unsynchronised off the CPU), and the rest.
Medians over repeats; on a GPU every clock is read after a device synchronisation.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

import gbv
import gbv.engine.static_steps as static_steps
from gbv.engine.static_steps import StaticSteps
from gbv.engine.tree_decoder import lean_model

from bench_engine import _median_ms, _recorded  # scripts/ is on the path when run as a script
from prompt_sets import benchmark_prompts

ROWS = (("ar", 1, 1), ("token", 1, 4), ("block", 1, 4), ("block", 1, 8), ("gbv", 3, 4), ("gbv", 3, 8),
        ("gbv-adaptive", 3, 4), ("specinfer", 3, 4), ("traversal", 3, 4), ("auto", 0, 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=2, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", default="0.2,1.0")
    parser.add_argument("--repeats", type=int, default=200, help="step timings per median")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    pair = gbv.load_pair("bundled", device=args.device, dtype=getattr(torch, args.dtype))
    views = {name: lean_model(model) for name, model in (("target", pair.target), ("draft", pair.draft))}
    steps = {name: lean.steps or StaticSteps(lean, capture=False) for name, lean in views.items()}

    def graphs(on: bool) -> None:
        for name, lean in views.items():
            lean.steps = steps[name] if on else None

    class Owner:  # a borrower of pooled caches
        pass

    def timed(fn, repeats: int) -> float:
        """Median ms of ``fn`` over ``repeats`` calls, in 10 batches."""
        return _median_ms(fn, 10, max(1, repeats // 10), device)

    # 1. Steps.
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, {args.dtype}, "
          f"torch {torch.__version__}")
    owner = Owner()
    with torch.inference_mode():
        for name, lean in views.items():
            cache = lean.new_cache(1, 512, owner=owner)
            lean.forward(torch.arange(64, device=device)[None] % 50, torch.arange(64, device=device)[None], 0, cache,
                         None, causal=True)
            one, at = torch.tensor([[7]], device=device), torch.tensor([[64]], device=device)
            nodes = 25
            tree = torch.tril(torch.ones(nodes, nodes, dtype=torch.bool, device=device))  # (a chain's mask)
            mask = torch.cat([torch.ones(nodes, 64, dtype=torch.bool, device=device), tree], 1)[None, None]
            many, where = torch.full((1, nodes), 7, device=device), torch.arange(64, 64 + nodes, device=device)[None]
            block = torch.full((1, 5), 7, device=device), torch.arange(64, 69, device=device)[None]
            result = {}
            for on in (False, True):
                graphs(on)
                result[on, 1] = timed(lambda: lean.forward(one, at, 64, cache, None), args.repeats)
                result[on, 5] = timed(lambda: lean.forward(*block, 64, cache, None, causal=True), args.repeats)
                result[on, nodes] = timed(lambda: lean.forward(many, where, 64, cache, mask), args.repeats)
            floor = ""
            if device.type == "cuda":
                x = {m: torch.randn(1, m.in_features, device=device, dtype=lean.dtype) for m in lean.matrices()}

                def matmuls():
                    for m in lean.matrices():
                        m(x[m])

                matmul_ms = timed(_recorded(matmuls, device), args.repeats)
                weight_bytes = sum(p.numel() * p.element_size() for p in lean.model.parameters())
                floor = (f"; its matrix multiplies alone {matmul_ms:.3f} ms (graph), so the replayed step is "
                         f"{result[True, 1] / matmul_ms:.2f}x them; {weight_bytes / 1e6:.1f} MB of weights at "
                         f"{weight_bytes / result[True, 1] / 1e6:.0f} GB/s")
            print(f"{name} 1-token step: eager {result[False, 1]:.3f} ms, graph {result[True, 1]:.3f} ms "
                  f"({result[False, 1] / result[True, 1]:.2f}x){floor}")
            print(f"{name} 5-token chain (BV L = 4's pass): eager {result[False, 5]:.3f} ms, graph {result[True, 5]:.3f} "
                  f"ms; {result[True, 5] / result[True, 1]:.2f}x the 1-token step")
            print(f"{name} {nodes}-node pass: eager {result[False, nodes]:.3f} ms, graph {result[True, nodes]:.3f} "
                  f"ms ({result[False, nodes] / result[True, nodes]:.2f}x); {result[True, nodes] / result[True, 1]:.2f}x"
                  f" the 1-token step")
    del owner

    # 1b. Variants of the replayed steps (fresh caches: graphs recorded anew), and each one's kernels.
    import gbv.engine.lean as lean_module
    defaults = lean_module.FUSED_NORM_ON_CUDA, static_steps.FEW_QUERY_ATTENTION
    graphs(True)
    with torch.inference_mode():
        for fused, few in ((False, False), (True, False), (False, True), (True, True)):
            lean_module.FUSED_NORM_ON_CUDA, static_steps.FEW_QUERY_ATTENTION = fused, few
            line = []
            for name, lean in views.items():
                cache = lean.plain_cache(1, 1024)
                lean.forward(torch.arange(64, device=device)[None] % 50, torch.arange(64, device=device)[None], 0,
                             cache, None, causal=True)
                one, at = torch.tensor([[7]], device=device), torch.tensor([[64]], device=device)
                many, where = torch.full((1, 25), 7, device=device), torch.arange(64, 89, device=device)[None]
                mask = torch.cat([torch.ones(25, 64, dtype=torch.bool, device=device),
                                  torch.tril(torch.ones(25, 25, dtype=torch.bool, device=device))], 1)[None, None]
                step_ms = timed(lambda: lean.forward(one, at, 64, cache, None), args.repeats)
                pass_ms = timed(lambda: lean.forward(many, where, 64, cache, mask), args.repeats)
                kernels = ""
                if device.type == "cuda":  # the kernels of one step, run unrecorded (the same kernels)
                    from torch.profiler import ProfilerActivity, profile
                    lean.steps.capture = False
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        lean.forward(one, at, 64, cache, None)
                        sync()
                    lean.steps.capture = True
                    spent: dict = {}
                    for e in prof.events():
                        if e.device_type == torch.autograd.DeviceType.CUDA:
                            count, us = spent.get(e.name, (0, 0.0))
                            spent[e.name] = (count + 1, us + e.time_range.elapsed_us())
                    top = sorted(spent.items(), key=lambda item: -item[1][1])[:8]
                    kernels = (f"; {sum(c for c, _ in spent.values())} kernels, {sum(u for _, u in spent.values()):.0f} us "
                               f"of kernel time: " + ", ".join(f"{k[:90]} x{c} {u:.0f}us" for k, (c, u) in top))
                line.append(f"{name} step {step_ms:.3f} ms, 25-node pass {pass_ms:.3f} ms{kernels}")
            print(f"fused norm {fused}, few-query attention {few}: " + " | ".join(line))
    lean_module.FUSED_NORM_ON_CUDA, static_steps.FEW_QUERY_ATTENTION = defaults

    # 2. Generations: eager; graphs per forward with the rest step by step (GBV_STATIC_ITERATION=0); graphs
    # with the drafting, each step's law and draw and the commit's moves recorded too (the default).
    variants = ("eager", "steps", "graphs")

    def variant(name: str) -> None:
        graphs(name != "eager")
        static_steps.RECORD_ITERATION = name == "graphs"

    prompts = benchmark_prompts(args.prompts)
    for temperature in (float(t) for t in args.temperature.split(",")):
        seconds: dict = {}
        tokens: dict = {}
        for index, prompt in enumerate(prompts):
            for method, k, length in ROWS:
                for name in (variants if index % 2 == 0 else variants[::-1]):
                    variant(name)
                    shape = dict(num_paths=k, block_len=length) if k else {}
                    sync()
                    began = time.perf_counter()
                    out = gbv.generate(pair, prompt=prompt, method=method, temperature=temperature,
                                       max_new_tokens=args.max_new_tokens, eos_token_id=[], seed=index, **shape)
                    sync()
                    key = (method, k, length, name)
                    seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - began
                    tokens[key] = tokens.get(key, 0) + out.stats.new_tokens
        rate = {key: tokens[key] / seconds[key] for key in tokens}
        ar = rate["ar", 1, 1, "graphs"]
        print(f"\nT={temperature}: {len(prompts)} prompts x {args.max_new_tokens} tokens, pooled tokens/s "
              "(steps: a graph per forward, the rest step by step; graphs: the drafting, the target's law and draw "
              "and the commit's moves recorded too, the default)")
        print("| row | eager tok/s | steps tok/s | graphs tok/s | graphs/eager | graphs/steps | graphs vs ar (graphs) |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for method, k, length in ROWS:
            eager, stepped, graphed = (rate[method, k, length, name] for name in variants)
            label = method if not k or method == "ar" else f"{method} K={k} L={length}"
            print(f"| {label} | {eager:.0f} | {stepped:.0f} | {graphed:.0f} | {graphed / eager:.2f}x | "
                  f"{graphed / stepped:.2f}x | {graphed / ar:.2f}x |")
        sys.stdout.flush()
    variant("graphs")

    # 4. Where a speculative iteration's time goes: the decoders' phase clocks, synchronised (``profile``;
    # the engine reads them unsynchronised off the CPU, where a sync would stall the pipeline).
    from gbv.engine.decoder import make_decoder
    from gbv.engine.generate import shared_vocab
    from gbv.engine.sampling import SamplingConfig
    vocab = shared_vocab(pair.target, pair.draft, pair.tokenizer)
    print("\nPhases per iteration, ms (synchronised clocks; T = 1; the same prompts):")
    print("| row | around the steps | iterations | tokens/iteration | draft | target | verify | other | total |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for (method, k, length), name in itertools.product(
                (("ar", 1, 1), ("token", 1, 4), ("block", 1, 4), ("gbv", 3, 8), ("traversal", 3, 4)),
                ("steps", "graphs")):
            variant(name)
            totals = [0, 0, 0.0, 0.0, 0.0, 0.0]  # iterations, tokens, draft, target, verify, wall
            for index, prompt in enumerate(prompts):
                decoder = make_decoder(pair.target, pair.draft, method, k, length, vocab, SamplingConfig(1.0),
                                       SamplingConfig(1.0), index, device)
                decoder.profile = True
                decoder.prefill(pair.tokenizer.encode(prompt))
                stats = decoder.stats
                draft0, target0, verify0 = stats.time_draft, stats.time_target, stats.time_verify
                produced, iterations = 0, 0
                sync()
                began = time.perf_counter()
                while produced < args.max_new_tokens:
                    produced += len(decoder.step())
                    iterations += 1
                sync()
                totals[0] += iterations
                totals[1] += produced
                totals[2] += stats.time_draft - draft0
                totals[3] += stats.time_target - target0
                totals[4] += stats.time_verify - verify0
                totals[5] += time.perf_counter() - began
            its = totals[0]
            draft_ms, target_ms, verify_ms, wall_ms = (1e3 * t / its for t in (totals[2], totals[3], totals[4], totals[5]))
            other_ms = wall_ms - draft_ms - target_ms - verify_ms
            label = method if method == "ar" else f"{method} K={k} L={length}"
            print(f"| {label} | {'recorded' if name == 'graphs' else 'step by step'} | {its} | {totals[1] / its:.2f} | {draft_ms:.3f} | {target_ms:.3f} | {verify_ms:.3f} | "
                  f"{other_ms:.3f} | {wall_ms:.3f} |")
    variant("graphs")
    sys.stdout.flush()

    # 4b. How busy the device is during decoding (no phase clocks, so no syncs but the engine's own): the
    # union of the kernels' and copies' intervals in a profiler trace, against the wall time.
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        print("\nDevice busy during decoding (profiler; 1 prompt, 64 tokens, T = 1, graphs):")
        for method, k, length in (("ar", 1, 1), ("block", 1, 4), ("gbv", 3, 8)):
            shape = dict(num_paths=k, block_len=length) if method != "ar" else {}
            run = lambda: gbv.generate(pair, prompt=prompts[0], method=method, temperature=1.0, max_new_tokens=64,
                                       eos_token_id=[], seed=0, **shape)
            run()  # (shapes recorded before the trace)
            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                began = time.perf_counter()
                out = run()
                sync()
                wall = time.perf_counter() - began
            spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA)
            busy, end = 0.0, None
            for a, b in spans:
                if end is None or a > end:
                    busy, end = busy + (b - a), b
                elif b > end:
                    busy, end = busy + (b - end), b
            its = out.stats.target_calls
            print(f"  {method if method == 'ar' else f'{method} K={k} L={length}'}: {its} iterations, "
                  f"{1e3 * wall / its:.3f} ms each under the profiler, device busy {busy / 1e3 / its:.3f} ms "
                  f"({busy / 1e6 / wall:.0%}), {len(spans) / its:.0f} device events each")

    # 3. Recording.
    for name in views:
        print(f"{name}: {steps[name].captures} graphs recorded in {steps[name].capture_seconds:.2f} s in all; shapes' "
              f"eager uses before their recording {steps[name].first_use_seconds:.2f} s")


if __name__ == "__main__":
    main()
