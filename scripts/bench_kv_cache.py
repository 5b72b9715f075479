"""A bfloat16 model's KV cache in bfloat16 (as the engine keeps it) against float32, in one process.

    python scripts/bench_kv_cache.py              # bundled pair in bfloat16, ~4 min

1. Lean forwards of the target and the draft: n new tokens (a causal chain: n = 1 a plain step, 3 a
   BV L = 2 pass, 25 a GBV K = 3 L = 8 tree's size) over P cached slots, the cache float32 or bfloat16
   (``LeanCausalLM.cache_dtype``), alternating; the medians in ms and float32 / bfloat16. Between two
   calls the same forward runs again, so the target's cache is read cold as in decoding (its 15.7 MB
   of weights stream in between), the draft's (3.7 MB of weights) much less so.
2. Attention alone (``host_kernels.attention_into``), n queries over 200 slots, 8 heads of 32, warm
   in the CPU's caches: the widening's arithmetic without the bytes it saves.

1 thread. The machine is shared: only the ratios within one run mean anything.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from gbv.engine import host_kernels
from gbv.engine.tree import prefix_then
from gbv.engine.tree_decoder import lean_model
from gbv.models.loading import load_pair


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    if host_kernels.host_kernels_unavailable():
        raise SystemExit(f"the compiled kernels do not run here: {host_kernels.host_kernels_unavailable()}")
    pair = load_pair("bundled", dtype="bfloat16")
    print("1. Lean forwards, n new tokens over P cached slots, ms (float32 cache / bfloat16 cache)\n")
    print("| model | P | n | float32 | bfloat16 | float32 / bfloat16 |\n|---|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name in ("target", "draft"):
            lean = lean_model(getattr(pair, name))
            if lean.cache_dtype != torch.bfloat16:
                raise SystemExit("the bfloat16 pair has no bfloat16 cache here")
            for prefix in (64, 128, 200, 300):
                for n in (1, 3, 5, 9, 25):
                    tokens, positions = torch.full((1, n), 7), prefix + torch.arange(n)[None]
                    mask = None if n == 1 else prefix_then(torch.tril(torch.ones(n, n, dtype=torch.bool)), prefix)
                    times = {torch.float32: [], torch.bfloat16: []}
                    for dtype in (torch.float32, torch.bfloat16) * 2:
                        lean.cache_dtype = dtype
                        cache = lean.new_cache(1, prefix + 32)
                        lean.forward(torch.arange(prefix)[None] % 100, torch.arange(prefix)[None], 0, cache, None,
                                     causal=True)
                        times[dtype].append(median_ms(lambda: lean.forward(tokens, positions, prefix, cache, mask),
                                                      150 if n < 9 else 40))
                    lean.cache_dtype = torch.bfloat16
                    wide, narrow = min(times[torch.float32]), min(times[torch.bfloat16])
                    print(f"| {name} | {prefix} | {n} | {wide:.3f} | {narrow:.3f} | {wide / narrow:.3f} |", flush=True)

    print("\n2. Attention alone, n queries over 200 slots (8 heads of 32), warm, us\n")
    print("| n | float32 cache | bfloat16 cache | bfloat16 / float32 |\n|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    heads, head_dim, end = 8, 32, 200
    keys = rng.standard_normal((8, 300, head_dim)).astype(np.float32)
    values = rng.standard_normal((8, 300, head_dim)).astype(np.float32)
    halves = [torch.from_numpy(a).to(torch.bfloat16).view(torch.uint16).numpy() for a in (keys, values)]
    for n in (1, 3, 5, 8, 25):
        qkv = rng.standard_normal((n, 3 * heads * head_dim)).astype(np.float32)
        out = np.zeros((n, heads * head_dim), np.float32)
        mask = np.ones((n, end), bool)
        times = {0: [], 1: []}
        for _ in range(30):
            for which, (k, v) in enumerate(((keys, values), halves)):
                def run(k=k, v=v):
                    for _ in range(100):
                        host_kernels.attention_into(qkv, k, v, out, mask, heads, end - n, end, 0.3)
                times[which].append(median_ms(run, 1) * 10)  # us per call
        wide, narrow = statistics.median(times[0]), statistics.median(times[1])
        print(f"| {n} | {wide:.1f} | {narrow:.1f} | {narrow / wide:.3f} |")


if __name__ == "__main__":
    main()
