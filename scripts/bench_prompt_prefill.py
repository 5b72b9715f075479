"""A prompt's prefill through the bundled target, three ways, and torch's GEMM at the same sizes (1 thread).

    python scripts/bench_prompt_prefill.py                       # float32 and bfloat16, 102 / 156 / 400 tokens

Forms: the engine's (one compiled call, ``HostForward.one_call``: panel products of up to 16 rows a
tile); the host forward's layer loop with torch's products for every product of more than
``KERNEL_MAX_ROWS`` rows (``_Product.into``), forced by switching the one call off; and the torch
forward (``LeanCausalLM.forward`` without the host forward). Then ``x @ W`` by torch for the four
products of a layer at 102 rows, in GFLOP/s: what a prefill kernel blocked for many rows could reach
(oneDNN's AMX kernels in bfloat16). Medians of 15 runs; the logits' largest gap to the one call's.
"""

from __future__ import annotations

import argparse

import torch

from gbv.engine import lean_host
from gbv.engine.tree_decoder import lean_model
from gbv.models.loading import load_pair

from bench_engine import _median_ms  # scripts/ is on the path when run as a script
from prompt_sets import benchmark_prompts


def median_ms(function, repeats: int = 15) -> float:
    """Median ms of ``repeats`` single calls, after a warm-up call (``bench_engine._median_ms``)."""
    return _median_ms(function, repeats, inner=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--lengths", default="102,156,400", help="prompt lengths in tokens")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    one_call, takes = lean_host.HostForward.one_call, lean_host.HostForward.takes
    print("| dtype | tokens | one compiled call | host layers, torch's products | torch forward | largest logit gap |")
    print("|---|---:|---:|---:|---:|---:|")
    for dtype in args.dtype.split(","):
        pair = load_pair("bundled", dtype=dtype)
        lean = lean_model(pair.target)
        text = " ".join(benchmark_prompts(5))
        for length in [int(n) for n in args.lengths.split(",")]:
            ids = pair.tokenizer(text)["input_ids"][:length]
            cache = lean.new_cache(1, length + 8)
            run = lambda: lean.chain(ids, 0, cache, static=False)  # noqa: E731
            times, logits = [median_ms(run)], [run().float()]
            try:  # the layer loop, its products of > KERNEL_MAX_ROWS rows by torch
                lean_host.HostForward.one_call = lambda self, n: n <= lean_host.KERNEL_MAX_ROWS and one_call(self, n)
                lean_host.HostForward.takes = lambda self, batch, n: batch == 1
                times.append(median_ms(run))
                logits.append(run().float())
            finally:
                lean_host.HostForward.one_call, lean_host.HostForward.takes = one_call, takes
            host, lean.host_forward = lean.host_forward, None
            try:
                times.append(median_ms(run))
                logits.append(run().float())
            finally:
                lean.host_forward = host
            gap = max((other - logits[0]).abs().max().item() for other in logits[1:])
            print(f"| {dtype} | {length} | {times[0]:.2f} ms | {times[1]:.2f} ms | {times[2]:.2f} ms | {gap:.1e} |")
    print("\ntorch's GEMM, 102 rows (GFLOP/s): ", end="")
    for dtype in (torch.float32, torch.bfloat16):
        rates = []
        for k, n in ((256, 768), (256, 256), (256, 1536), (768, 256)):
            x, w = torch.randn(102, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            rates.append(f"{2 * 102 * k * n / median_ms(lambda: x @ w, 50) / 1e6:.0f}")
        print(f"{str(dtype)[6:]} {' / '.join(rates)} (K x N = 256x768, 256x256, 256x1536, 768x256)", end="; ")
    print()


if __name__ == "__main__":
    main()
