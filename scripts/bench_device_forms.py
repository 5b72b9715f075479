#!/usr/bin/env python3
"""The host and device forms of GBV, gbv-adaptive, SpecInfer, SpecTr and Traversal against each other, on
this machine's CPU.

``verify_gbv`` / ``verify_gbv_adaptive`` / ``verify_specinfer`` / ``verify_spectr`` / ``verify_traversal``
run their host form on CPU tensors and their device form (``verify_*_on_device``: tensor code, one
host read per call) on any other device. This script shows what the device forms would cost if the
CPU ran them too, which is why it does not:

    python scripts/bench_device_forms.py                      # one verify call, V = 4096 and 32000
    python scripts/bench_device_forms.py --engine             # the engine on the bundled pair, K = 3

Verify calls: the inputs of scripts/bench_verifiers.py (``--instances`` per configuration), the two
forms called alternately on each instance (the order swapped every round), 1 thread; the ratio of
mean times device / host. ``--engine``: ``gbv`` K = 3 L = 8 and ``gbv-adaptive`` K = 3 L = 4 on
``--prompts`` GSM8K + HumanEval prompts each, both forms per prompt in alternating order
(``bench_verify_ab.engine_ab``), T = 0.2 and 1, 96 new tokens; tokens/s, verify milliseconds per
iteration and the forwards' share of the wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_verifiers import make_inputs  # noqa: E402

import gbv.verify.gbv as gbv_module  # noqa: E402
import gbv.verify.gbv_adaptive as adaptive_module  # noqa: E402
import gbv.verify.specinfer as specinfer_module  # noqa: E402
import gbv.verify.spectr as spectr_module  # noqa: E402
import gbv.verify.traversal as traversal_module  # noqa: E402
from gbv.verify import TorchRandom  # noqa: E402

FORMS = {"gbv": (gbv_module.verify_gbv, gbv_module.verify_gbv_on_device),
         "gbv-adaptive": (adaptive_module.verify_gbv_adaptive, adaptive_module.verify_gbv_adaptive_on_device),
         "specinfer": (specinfer_module.verify_specinfer, specinfer_module.verify_specinfer_on_device),
         "spectr": (spectr_module.verify_spectr, spectr_module.verify_spectr_on_device),
         "traversal": (traversal_module.verify_traversal, traversal_module.verify_traversal_on_device)}


def verify_calls(args) -> None:
    print("| method | V | K | L | host ms | device ms | device / host |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for method in args.methods:
        host, device = FORMS[method]
        for vocab in args.vocab:
            for num_paths, block_len in ((3, 4), (3, 8), (4, 8)):
                instances = [make_inputs(vocab, num_paths, block_len, seed) for seed in range(args.instances)]
                rng = TorchRandom(seed=0)
                for inputs in instances[:2]:
                    host(*inputs, rng)
                    device(*inputs, rng)
                times = {host: [], device: []}
                for rnd in range(args.rounds):
                    for inputs in instances:
                        for form in ((host, device) if rnd % 2 == 0 else (device, host)):
                            start = time.perf_counter()
                            form(*inputs, rng)
                            times[form].append((time.perf_counter() - start) * 1e3)
                a, b = statistics.fmean(times[host]), statistics.fmean(times[device])
                print(f"| {method} | {vocab} | {num_paths} | {block_len} | {a:.2f} | {b:.2f} | {b / a:.2f} |", flush=True)


def engine(args) -> None:
    """Both forms in the engine: the host form is the registered function itself (CPU tensors), the
    device form swapped in for it (bench_verify_ab.engine_ab)."""
    from bench_verify_ab import engine_ab

    settings = {"gbv": (3, 8), "gbv-adaptive": (3, 4), "specinfer": (3, 4), "spectr": (3, 4), "traversal": (3, 4)}
    for method in args.methods:
        host, device = FORMS[method]
        engine_ab(method, *settings[method], args.prompts, {"host": host, "device": device})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", choices=sorted(FORMS), default=sorted(FORMS))
    parser.add_argument("--vocab", nargs="+", type=int, default=[4096, 32000])
    parser.add_argument("--instances", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4, help="calls of each form per instance")
    parser.add_argument("--engine", action="store_true", help="the engine on the bundled pair instead")
    parser.add_argument("--prompts", type=int, default=8, help="--engine: GSM8K + HumanEval prompts, each")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine(args) if args.engine else verify_calls(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
