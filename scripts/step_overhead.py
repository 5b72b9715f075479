"""What a plain target step spends outside its compiled forward, with the one-call path on and off.

    python scripts/step_overhead.py --dtype bfloat16 --prompts 4

Runs ``ar`` (T = 1, 128 new tokens, EOS off, 1 thread) over ``--prompts`` GSM8K prompts, alternately
with the one-call path on (the sequence's forward, softmax and draw in one compiled call, uniforms
from the decoder's ``TorchRandom.uniform``: what the engine does) and off (one compiled call per layer, the softmax
and the draw on torch: ``HostForward.layer_panels = None`` and the compiled softmax switched off, as
before the sixteenth session). For each it prints the medians, over all steps, of the whole
``TreeDecoder._target_step``, of the compiled calls inside it (``_host_kernels.forward`` or
``_host_kernels.layer`` + ``matmul``), of the rest of the step, and of the gap between two steps (the
row loop, ``auto``'s choice if any). The machine is shared: compare within one run.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gbv.data import load_prompts
from gbv.engine import host_kernels, sampling, tree_decoder
from gbv.engine.generate import generate
from gbv.engine.tree_decoder import lean_model
from gbv.models.loading import load_pair


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--method", default="ar", help="ar or auto")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    hosts = [lean_model(pair.target).host_forward, lean_model(pair.draft).host_forward]
    if any(h is None or h.layer_panels is None for h in hosts):
        raise SystemExit("the compiled one-call forward does not run here")
    panels = [h.layer_panels for h in hosts]
    host_softmax = sampling._host_softmax
    prompts = [pair.tokenizer(p)["input_ids"] for p in load_prompts("gsm8k", args.prompts)]

    clock = {"step": [], "compiled": [], "gap": []}
    inside = [0.0]
    last_end = [None]
    kernels = host_kernels._host_kernels

    class Timed:  # the compiled module, each call timed
        def __getattr__(self, name):
            function = getattr(kernels, name)
            if name not in ("forward", "layer", "matmul", "softmax_draw", "draw_rows"):
                return function

            def timed(*a):
                start = time.perf_counter()
                try:
                    return function(*a)
                finally:
                    inside[0] += time.perf_counter() - start
            return timed

    target_step = tree_decoder.TreeDecoder._target_step

    def timed_step(self):
        start = time.perf_counter()
        if last_end[0] is not None:
            clock["gap"].append(start - last_end[0])
        inside[0] = 0.0
        out = target_step(self)
        last_end[0] = time.perf_counter()
        clock["step"].append(last_end[0] - start)
        clock["compiled"].append(inside[0])
        return out

    host_kernels._host_kernels = Timed()
    tree_decoder.TreeDecoder._target_step = timed_step
    generate(pair, prompt_ids=prompts[0], method=args.method, max_new_tokens=16, eos_token_id=[])  # warm-up
    results = {True: {k: [] for k in clock}, False: {k: [] for k in clock}}
    for index, ids in enumerate(prompts * 2):
        for on in ((True, False) if index % 2 else (False, True)):
            for host, layer_panels in zip(hosts, panels):
                host.layer_panels = layer_panels if on else None
            sampling._host_softmax = host_softmax if on else (lambda logits, config: False)
            for values in clock.values():
                values.clear()
            last_end[0] = None
            generate(pair, prompt_ids=ids, method=args.method, max_new_tokens=128, eos_token_id=[], seed=index)
            for key, values in clock.items():
                results[on][key] += values
    print(f"{args.dtype}, {args.method}, {len(prompts)} prompts x 2 per variant, us per plain step (medians)\n")
    print("| path | step | compiled calls | rest of the step | gap between steps |")
    print("|---|---:|---:|---:|---:|")
    for on in (False, True):
        r = {k: statistics.median(v) * 1e6 for k, v in results[on].items()}
        rest = statistics.median(s - c for s, c in zip(results[on]["step"], results[on]["compiled"])) * 1e6
        name = "one call (now)" if on else "call per layer, torch softmax and draw (before)"
        print(f"| {name} | {r['step']:.0f} | {r['compiled']:.0f} | {rest:.0f} | {r['gap']:.0f} |")


if __name__ == "__main__":
    main()
