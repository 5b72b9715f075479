"""Torch calls an iteration makes outside recorded work, on the GPU's code path, counted on the CPU.

    python scripts/launch_counts.py              # bundled pair, 2 prompts x 64 tokens, T = 1
    python scripts/launch_counts.py --ops        # and the most frequent calls of each row

On a GPU with CUDA graphs, what a replay records costs one launch; every other torch call is
launched from Python one by one (~5-20 us of host time each, against a 0.36 ms replayed target step
on an H200). This runs the engine as a GPU does (the torch forward, not the host one: static steps
without capture, ``GBV_CUDA_GRAPHS=static``; torch's softmax and draws, ``GBV_HOST_KERNELS=0``; the
verifier on the host) and counts the aten calls per iteration: outside the static calls (each one a
launch or a view's dispatch on a GPU), inside them (recorded), and in the verifier (host work there).
Both forms of the work around the static steps, in one run: step by step (``GBV_STATIC_ITERATION=0``:
one recorded forward at a time, the rest launched call by call) and the default, where an iteration's
drafting, the target's law and draw and the commit's cache moves are recorded too
(gbv/engine/static_sampling.py, ``StaticMove``). Counts do not depend on timing.
"""
from __future__ import annotations

import argparse
import collections
import os

os.environ["GBV_CUDA_GRAPHS"] = "static"
os.environ["GBV_HOST_FORWARD"] = "0"
os.environ["GBV_HOST_KERNELS"] = "0"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import gbv  # noqa: E402
import gbv.engine.decoder as decoder_module  # noqa: E402
from gbv.engine import static_sampling, static_steps, tree_decoder  # noqa: E402
from prompt_sets import benchmark_prompts

ROWS = (("ar", 1, 1), ("token", 1, 4), ("block", 1, 4), ("gbv", 3, 8), ("gbv-adaptive", 3, 4), ("traversal", 3, 4))


class Where:
    """Which part of an iteration is running: depth counters set by wrapped methods."""

    step = 0  # (only an iteration's calls count: not the prompt's prefill)
    recorded = 0
    verify = 0


def _wrap(cls, name: str, flag: str) -> None:
    original = cls.__dict__[name]

    def wrapped(self, *args, **kwargs):
        setattr(Where, flag, getattr(Where, flag) + 1)
        try:
            return original(self, *args, **kwargs)
        finally:
            setattr(Where, flag, getattr(Where, flag) - 1)

    setattr(cls, name, wrapped)


class Count(TorchDispatchMode):
    """Aten calls by where they run; the outside ones by name."""

    def __init__(self) -> None:
        super().__init__()
        self.where: collections.Counter = collections.Counter()
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not Where.step:
            return func(*args, **(kwargs or {}))
        where = "recorded" if Where.recorded else "verify" if Where.verify else "outside"
        self.where[where] += 1
        if where == "outside":
            self.names[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--ops", action="store_true", help="list each row's most frequent outside calls")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for cls in (static_steps.StaticStep, static_sampling.DraftLoop, static_sampling.SampledStep, static_steps.StaticMove):
        _wrap(cls, "_run", "recorded")
    decoder_module.verifies_on_host = lambda device: True  # as on a GPU (a no-op copy on the CPU)
    _wrap(decoder_module.DecoderState, "verify", "verify")
    _wrap(tree_decoder.TreeDecoder, "step", "step")
    pair = gbv.load_pair("bundled")
    prompts = benchmark_prompts(args.prompts)
    print(f"Torch calls per iteration, {len(prompts)} prompts x {args.max_new_tokens} tokens, T = {args.temperature}")
    print("| row | around the steps | iterations | outside recorded calls | recorded | verifier (host) |")
    print("|---|---|---:|---:|---:|---:|")  # (per iteration: TreeDecoder.step, prefill not counted)
    lists = []
    for method, k, length in ROWS:
        for enabled in (False, True):
            static_steps.RECORD_ITERATION = enabled
            settings = dict(method=method, num_paths=k, block_len=length, temperature=args.temperature,
                            eos_token_id=[])
            gbv.generate(pair, prompt=prompts[0], max_new_tokens=16, seed=99, **settings)  # (steps made)
            iterations = 0
            with Count() as count:
                for index, prompt in enumerate(prompts):
                    out = gbv.generate(pair, prompt=prompt, max_new_tokens=args.max_new_tokens, seed=index, **settings)
                    iterations += out.stats.to_dict()["target_calls"]
            label = method if method == "ar" else f"{method} K={k} L={length}"
            form = "recorded" if enabled else "step by step"
            print(f"| {label} | {form} | {iterations} | {count.where['outside'] / iterations:.1f} | "
                  f"{count.where['recorded'] / iterations:.1f} | {count.where['verify'] / iterations:.1f} |")
            if args.ops:
                top = ", ".join(f"{name.removeprefix('aten.')} {n / iterations:.1f}"
                                for name, n in count.names.most_common(12))
                lists.append(f"{label}, {form}: {top}")
    for line in lists:
        print(line)


if __name__ == "__main__":
    main()
