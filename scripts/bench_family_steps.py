"""One-token decode steps of small models of real sizes in the families the compiled host forward computes
beside Llama's (GPT-NeoX, GPT-2): the host forward against the torch forward, on one thread and on two.

    python scripts/bench_family_steps.py
    python scripts/bench_family_steps.py --models pythia-70m --steps 60

The models are random, built from configurations of these sizes (no download): ``pythia-70m`` (GPT-NeoX:
hidden 512, 6 layers, 8 heads, a quarter of each head rotated, 50k vocabulary) and ``distilgpt2`` (GPT-2: 6
layers of GPT-2 small's). Each step is ``LeanCausalLM.forward`` of one token after a 100-token prompt
(last only), medians over ``--steps`` steps after 10 untimed ones, in one process. At these sizes a step
reads its weights from memory (280-330 MB in float32), so the compiled forward saves less of it than on the
bundled shapes (docs/ENGINE.md, "The compiled host forward for the LayerNorm families").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
from engine_toy import real_size  # noqa: E402


def step_ms(lean, steps: int) -> float:
    cache = lean.new_cache(1, 128 + steps)
    times = []
    with torch.inference_mode():
        lean.forward(torch.arange(100)[None], torch.arange(100)[None], 0, cache, None, causal=True)
        for i in range(steps + 10):
            began = time.perf_counter()
            lean.forward(torch.tensor([[5]]), torch.tensor([[100 + i]]), 100 + i, cache, None, last_only=True)
            times.append(time.perf_counter() - began)
    return 1e3 * float(np.median(times[10:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="pythia-70m,distilgpt2")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    from gbv.engine.lean import LeanCausalLM

    print("| model | parameters | host forward, 1 thread | torch forward, 1 thread | torch forward, 2 threads |")
    print("|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        model = real_size(name)
        torch.set_num_threads(1)
        lean = LeanCausalLM(model)
        host = lean.host_forward
        if host is None:
            raise SystemExit(f"bench_family_steps: {name} has no host forward here (no compiled kernels?)")
        row = [step_ms(lean, args.steps)]
        lean.host_forward = None
        row.append(step_ms(lean, args.steps))
        torch.set_num_threads(2)
        row.append(step_ms(lean, args.steps))
        lean.host_forward = host
        torch.set_num_threads(1)
        count = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"| {name} | {count:.0f}M | " + " | ".join(f"{ms:.2f} ms" for ms in row) + " |")


if __name__ == "__main__":
    main()
