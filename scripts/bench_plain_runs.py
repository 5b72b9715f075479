"""ar's plain steps in runs of one recorded call (gbv/engine/static_sampling.py, ``PlainLoop``) against
one call per step, in one process, bundled pair.

    python scripts/bench_plain_runs.py                  # on a GPU: float32, 2 + 2 prompts, 128 tokens
    python scripts/bench_plain_runs.py --device cpu     # a dry run: static steps without capture

Rows: ``ar`` and ``auto`` with runs of at most 1 (a call per step, the form before), 4, 8 (the
default) and 16 plain steps (``static_sampling.PLAIN_RUN``), alternating per prompt (drift hits them
alike). Pooled tokens/s of each row and its ratio to ``ar`` with a call per step; every clock read
after a device synchronisation. ``--eos`` lets generations stop at the tokenizer's EOS, where a run's
steps after the EOS are thrown away. On the CPU the static steps run their torch code without
recording (``GBV_CUDA_GRAPHS=static``, the torch forward): the numbers there say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=2, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", default="0.2,1.0")
    parser.add_argument("--runs", default="1,4,8,16", help="longest runs to compare (powers of two)")
    parser.add_argument("--eos", action="store_true", help="stop at EOS (default: off, every row 128 tokens)")
    args = parser.parse_args()
    if args.device == "cpu":  # (read when the lean views are made: before loading the pair)
        os.environ["GBV_CUDA_GRAPHS"], os.environ["GBV_HOST_FORWARD"] = "static", "0"
    import gbv
    import gbv.engine.static_sampling as static_sampling
    from prompt_sets import benchmark_prompts

    torch.set_num_threads(1)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    pair = gbv.load_pair("bundled", device=args.device, dtype=getattr(torch, args.dtype))
    runs = [int(r) for r in args.runs.split(",")]
    if any(r < 1 or r & (r - 1) for r in runs):
        parser.error(f"--runs takes powers of two, not {args.runs!r}")
    rows = [(method, run) for method in ("ar", "auto") for run in runs]
    prompts = benchmark_prompts(args.prompts)
    eos = {} if args.eos else {"eos_token_id": []}
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, {args.dtype}, "
          f"torch {torch.__version__}; {len(prompts)} prompts x {args.max_new_tokens} tokens, EOS "
          f"{'on' if args.eos else 'off'}")
    for temperature in (float(t) for t in args.temperature.split(",")):
        seconds: dict = {}
        tokens: dict = {}
        calls: dict = {}
        with torch.inference_mode():  # (a warm-up generation per row: recordings out of the clocks)
            for method, run in rows:
                static_sampling.PLAIN_RUN = run
                gbv.generate(pair, prompt=prompts[0], method=method, temperature=temperature, max_new_tokens=32,
                             seed=99, **eos)
        for index, prompt in enumerate(prompts):
            order = rows[index % len(rows):] + rows[:index % len(rows)]
            for method, run in (order if index % 2 == 0 else order[::-1]):
                static_sampling.PLAIN_RUN = run
                sync()
                began = time.perf_counter()
                out = gbv.generate(pair, prompt=prompt, method=method, temperature=temperature,
                                   max_new_tokens=args.max_new_tokens, seed=index, **eos)
                sync()
                key = (method, run)
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - began
                tokens[key] = tokens.get(key, 0) + out.stats.new_tokens
                calls[key] = calls.get(key, 0) + out.stats.target_calls
        rate = {key: tokens[key] / seconds[key] for key in tokens}
        base = rate["ar", 1] if ("ar", 1) in rate else rate[rows[0]]
        print(f"\nT = {temperature}:")
        print("| row | longest run | tokens/s | vs ar, a call per step | target forwards per token |")
        print("|---|---:|---:|---:|---:|")
        for method, run in rows:
            key = (method, run)
            print(f"| {method} | {run} | {rate[key]:.0f} | {rate[key] / base:.3f}x | {calls[key] / tokens[key]:.3f} |")
    static_sampling.PLAIN_RUN = static_sampling._plain_run()


if __name__ == "__main__":
    main()
