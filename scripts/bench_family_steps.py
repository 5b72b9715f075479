"""One-token decode steps of models of real sizes: the host forward against the torch forward, on one thread
and on two.

    python scripts/bench_family_steps.py
    python scripts/bench_family_steps.py --models pythia-70m --steps 60
    python scripts/bench_family_steps.py --models smollm2-360m,pythia-410m --dtype bfloat16
    python scripts/bench_family_steps.py --models pythia-410m --context 2000 --forms host

The models are random, built from configurations of these sizes (no download): ``pythia-70m`` (GPT-NeoX:
hidden 512, 6 layers, 8 heads, a quarter of each head rotated, 50k vocabulary) and ``distilgpt2`` (GPT-2: 6
layers of GPT-2 small's). Each step is ``LeanCausalLM.forward`` of one token after a 100-token prompt
(last only), medians over ``--steps`` steps after 10 untimed ones, in one process. At these sizes a step
reads its weights from memory (280-330 MB in float32), so the compiled forward saves less of it than on the
bundled shapes (docs/ENGINE.md, "The compiled host forward for the LayerNorm families"). Any of
``engine_toy.REAL_SIZES`` may be named, Llama's SmolLM2 shapes too; past 100M parameters the compiled products
split their columns among the threads (docs/ENGINE.md, "The compiled forward on several threads").
``--dtype bfloat16``: the models in bfloat16 (run in float32 over bfloat16 panels where the kernels run).
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


def step_ms(lean, steps: int, context: int = 100) -> float:
    cache = lean.new_cache(1, context + 28 + steps)
    times = []
    with torch.inference_mode():
        lean.forward(torch.arange(context)[None] % 1000, torch.arange(context)[None], 0, cache, None, causal=True)
        for i in range(steps + 10):
            began = time.perf_counter()
            lean.forward(torch.tensor([[5]]), torch.tensor([[context + i]]), context + i, cache, None, last_only=True)
            times.append(time.perf_counter() - began)
    return 1e3 * float(np.median(times[10:]))


def as_built(args) -> None:
    """``--as-built``: each model's lean view as gbv builds it (its own forward choice) at gbv's default threads."""
    import gbv
    from gbv.engine.threads import apply_threads
    from gbv.engine.tree_decoder import lean_model

    print(f"{args.dtype}, medians of {args.steps} steps after {args.context} tokens, as built at gbv's default "
          f"threads (gbv from {Path(gbv.__file__).parent})\n")
    print("| model | parameters | forward | torch's threads | lean view built in | step |")
    print("|---|---:|---|---:|---:|---:|")
    for name in args.models.split(","):
        model = real_size(name).to(getattr(torch, args.dtype))
        began = time.perf_counter()
        apply_threads(None, model)
        lean = lean_model(model)
        built = time.perf_counter() - began
        form = "compiled" if lean.host_forward is not None and lean.host_forward.one_call(1) else (
            "host" if lean.host_forward is not None else "torch")
        ms = step_ms(lean, args.steps, args.context)
        count = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"| {name} | {count:.0f}M | {form} | {torch.get_num_threads()} | {built:.1f} s | {ms:.2f} ms |",
              flush=True)
        del lean, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="pythia-70m,distilgpt2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--context", type=int, default=100, help="the prompt's tokens before the timed steps")
    parser.add_argument("--forms", default="host,torch", help="which forwards to time (host, torch or both)")
    parser.add_argument("--as-built", action="store_true",
                        help="time the forward the lean view chose, at gbv's default threads for the model (what "
                             "a user gets; any gbv on PYTHONPATH, for a before/after run)")
    args = parser.parse_args()
    if args.as_built:
        as_built(args)
        return
    from gbv.engine.lean import LeanCausalLM

    import gbv

    print(f"{args.dtype}, medians of {args.steps} steps after {args.context} tokens (gbv from "
          f"{Path(gbv.__file__).parent})\n")
    print("| model | parameters | host forward, 1 thread | host forward, 2 threads | torch forward, 1 thread "
          "| torch forward, 2 threads |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        model = real_size(name).to(getattr(torch, args.dtype))
        torch.set_num_threads(1)
        lean = LeanCausalLM(model)
        host = lean.host_forward
        if host is None or not host.one_call(1):
            raise SystemExit(f"bench_family_steps: {name} has no compiled host forward here "
                             f"({getattr(host, 'panels_off', None) or 'no host forward'})")
        forms = args.forms.split(",")
        row = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            row.append(step_ms(lean, args.steps, args.context) if "host" in forms else float("nan"))
        lean.host_forward = None
        for threads in (1, 2):
            torch.set_num_threads(threads)
            row.append(step_ms(lean, args.steps, args.context) if "torch" in forms else float("nan"))
        lean.host_forward = host
        torch.set_num_threads(1)
        count = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"| {name} | {count:.0f}M | " + " | ".join(f"{ms:.2f} ms" for ms in row) + " |", flush=True)


if __name__ == "__main__":
    main()
