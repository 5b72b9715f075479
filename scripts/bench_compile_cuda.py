"""torch.compile (inductor) of the engine's static forward, replayed as a CUDA graph, against the
engine's own graph of the eager kernels (gbv/engine/static_steps.py); bundled pair, one process.

    python scripts/bench_compile_cuda.py                                  # on a GPU: target 1 and 5 queries, draft 1
    python scripts/bench_compile_cuda.py --device cpu --models draft      # a dry run (no graphs; inductor's C++)

Why: on the H200 the engine's replayed 1-token target step took 0.36 ms, 3.6x its matrix products
recorded alone and about 40x the time to read its 31.5 MB of weights: 147 kernels, most of them small
elementwise ones (norms, rotation, softmax, residual adds), each a few microseconds even in a graph.
Inductor fuses such chains into a few kernels. This measures what that gives per forward, and what it
costs to compile (per shape), before building it into the engine. Prints, per (model, queries): the
compile seconds, the replayed eager graph and the replayed compiled graph (medians, ms), their ratio,
and the largest logit difference between the two. The compiled call writes the cache like the eager one.
"""
from __future__ import annotations

import argparse
import time

import torch

import gbv
from gbv.engine.static_steps import static_forward
from gbv.engine.tree_decoder import lean_model

from bench_engine import _median_ms, _recorded  # scripts/ is on the path when run as a script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--models", default="target,draft")
    parser.add_argument("--queries", default="1,5", help="query counts of the target (the draft: 1)")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    pair = gbv.load_pair("bundled", device=args.device, dtype=getattr(torch, args.dtype))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if cuda else 'cpu'}, {args.dtype}")
    for name in args.models.split(","):
        lean = lean_model(getattr(pair, name))
        lean.steps = None  # (the eager forward for the prefix; the calls below are built by hand)
        cache = lean.plain_cache(1, 1024)
        capacity = cache.capacity
        with torch.inference_mode():
            lean.forward(torch.arange(64, device=device)[None] % 50, torch.arange(64, device=device)[None], 0, cache,
                         None, causal=True)
        lean.ensure_rotary(capacity)
        columns = torch.arange(capacity, device=device)
        for n in [int(q) for q in args.queries.split(",")] if name == "target" else [1]:
            tokens = torch.full((1, n), 7, device=device)
            slots = torch.arange(64, 64 + n, device=device)
            mask = (columns[None, :] <= slots[:, None])[None, None]

            def forward():
                return static_forward(lean, tokens, slots[None], slots, mask, cache, capacity, 0, n == 1)

            with torch.inference_mode():
                reference = forward().clone()
                eager = _recorded(forward, device) if cuda else forward
                eager_ms = _median_ms(eager, 10, max(1, args.repeats // 10), device)
                torch._dynamo.reset()
                compiled = torch.compile(forward, dynamic=False)
                began = time.perf_counter()
                out = compiled()
                if cuda:
                    torch.cuda.synchronize(device)
                compile_s = time.perf_counter() - began
                gap = (out.float() - reference.float()).abs().max().item()
                replayed = _recorded(compiled, device) if cuda else compiled
                compiled_ms = _median_ms(replayed, 10, max(1, args.repeats // 10), device)
            breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
            print(f"{name}, {n} quer{'y' if n == 1 else 'ies'}: compiled in {compile_s:.1f} s ({breaks} graph breaks); "
                  f"{'graph of ' if cuda else ''}eager kernels {eager_ms:.3f} ms, {'graph of ' if cuda else ''}"
                  f"compiled kernels {compiled_ms:.3f} ms ({eager_ms / compiled_ms:.2f}x); largest logit gap {gap:.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
