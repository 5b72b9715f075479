#!/usr/bin/env python3
"""Micro-benchmark: time of one verify call per method (gbv.verify.METHODS), on CPU.

Inputs are float32 random softmax distributions (target logits = draft logits + noise, so tokens
are sometimes accepted; the root rows are shared by all paths, as in a real draft tree) and tokens
drafted from q, ``--instances`` of them per configuration (seeds ``--seed``, ``--seed`` + 1, ...); the
timed calls cycle through them. Why several: the cost of a call depends on the instance (GBV with a
whole block accepted computes no residual mass and takes a fraction of the time of one that stops
early), so a single instance can make a method look several times cheaper or dearer than it is on
average. One thread, a seeded TorchRandom per configuration, warm-up calls, then the mean, median
and 90th percentile over the timed calls, of wall time or (``--clock cpu``) process CPU time, which
is steadier on a busy machine. Methods whose module does not import (yet) are skipped with a note.
``gbv-device``, ``gbv-adaptive-device``, ``specinfer-device``, ``spectr-device`` and ``traversal-device``
are the device forms (``verify_*_on_device`` in :mod:`gbv.verify`: what those methods run on a GPU,
tensor code, one host read); ``specinfer-host``, ``spectr-host`` and ``traversal-host`` their host forms
(what they run on CPU tensors), so that a GPU run times both; and off the CPU ``METHOD-via-host``,
what the engine runs there: the inputs copied to the host in one synchronisation, then the method
with a host generator (``gbv.engine.decoder.verifies_on_host``). ``--device cuda`` runs everything on a
GPU (the clock is read after a device synchronisation).
Every configuration also times one ``torch.softmax`` over ``p`` (the (K, L+1, V) tensor) on the same
instances in the same process, and reports each method's mean as a multiple of its mean (the
yardstick of issue 8: ``gbv`` at K = 4, L = 8 within 3x, which a last table says met or not). Prints a
markdown table; ``--out FILE`` also writes it.

    python3 scripts/bench_verifiers.py --out bench.md
    python3 scripts/bench_verifiers.py --clock cpu --out bench_cpu.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from gbv.bench.engine_goals import VERIFY_BLOCK, VERIFY_PATHS, goals_markdown, verifier_goals
from gbv.engine.decoder import host_copies
from gbv.verify import METHODS, TorchRandom, get_verifier
from gbv.verify.gbv import verify_gbv_on_device
from gbv.verify.gbv_adaptive import verify_gbv_adaptive_on_device
from gbv.verify.specinfer import verify_specinfer_on_device, verify_specinfer_on_host
from gbv.verify.spectr import verify_spectr_on_device, verify_spectr_on_host
from gbv.verify.traversal import verify_traversal_on_device, verify_traversal_on_host

# Forms beside the registered methods (the name -> function of the rows).
EXTRA_FORMS = {"gbv-device": verify_gbv_on_device, "gbv-adaptive-device": verify_gbv_adaptive_on_device,
               "specinfer-device": verify_specinfer_on_device, "spectr-device": verify_spectr_on_device,
               "traversal-device": verify_traversal_on_device,
               # and the host forms, so that on a GPU (where the registered names run the device forms)
               # both are timed: SpecInfer's, SpecTr's and Traversal's device forms launch 6-31x the host
               # forms' ops.
               "specinfer-host": verify_specinfer_on_host, "spectr-host": verify_spectr_on_host,
               "traversal-host": verify_traversal_on_host}


def via_host(verifier):
    """What a decoder runs off the CPU (``gbv.engine.decoder.verifies_on_host``): the inputs copied to
    the host after one synchronisation, then the verifier (its host form) with a host generator."""
    host_rng = TorchRandom(seed=0)

    def run(tokens, q, p, rng):
        return verifier(*host_copies(tokens, q, p), host_rng)
    return run


def make_inputs(vocab: int, num_paths: int, block_len: int, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K, L) tokens, (K, L, V) q, (K, L+1, V) p; float32, seeded."""
    gen = torch.Generator().manual_seed(seed)
    q_logits = 2.0 * torch.randn(num_paths, block_len, vocab, generator=gen)
    q_logits[1:, 0] = q_logits[0, 0].clone()  # the root node is the same for every path
    p_logits = torch.cat([q_logits, 2.0 * torch.randn(num_paths, 1, vocab, generator=gen)], dim=1)
    p_logits = p_logits + torch.randn(num_paths, block_len + 1, vocab, generator=gen)
    p_logits[1:, 0] = p_logits[0, 0].clone()
    q = torch.softmax(q_logits, dim=-1)
    p = torch.softmax(p_logits, dim=-1)
    tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(num_paths, block_len)
    return tokens, q, p


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_method(verifier, instances: list, seed: int, repeats: int, warmup: int, clock=time.perf_counter
                ) -> list[float]:
    """Milliseconds of each timed call; call ``i`` runs ``instances[i % len(instances)]``. On a GPU
    the clock is read after a synchronisation, and the random source's generator lives there."""
    device = instances[0][2].device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    generator = torch.Generator(device=device).manual_seed(seed)
    rng = TorchRandom(generator=generator)
    for i in range(warmup):
        verifier(*instances[i % len(instances)], rng)
    times = []
    for i in range(repeats):
        inputs = instances[i % len(instances)]
        sync()
        start = clock()
        verifier(*inputs, rng)
        sync()
        times.append((clock() - start) * 1e3)
    return times


def percentile(values: list[float], frac: float) -> float:
    ordered = sorted(values)
    pos = frac * (len(ordered) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=None,
                        help="default: all of gbv.verify.METHODS and " + ", ".join(EXTRA_FORMS) + "; off the "
                        "CPU also METHOD-via-host for each method (what the engine runs there)")
    parser.add_argument("--vocab", nargs="+", type=int, default=[32000, 128000])
    parser.add_argument("--paths", nargs="+", type=int, default=[1, 4], help="K values")
    parser.add_argument("--block-len", type=int, default=8, help="L")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per configuration (>= 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--instances", type=int, default=10,
                        help="random instances per configuration, cycled through by the timed calls")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--numpy-only", action="store_true",
                        help="run the host forms without gbv/verify/_verify_kernels.c (its numpy code)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: process CPU time (steadier on a busy machine)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        parser.error(f"--device {args.device}: only cpu, or cuda where a CUDA device is present")
    if args.instances < 1:
        parser.error("--instances must be at least 1")
    torch.set_num_threads(args.threads)
    if args.numpy_only:
        from gbv.verify import common
        common.compiled_kernels = None

    if args.methods is None:
        args.methods = [*METHODS, *EXTRA_FORMS] + ([f"{m}-via-host" for m in METHODS] if args.device != "cpu" else [])
    verifiers, notes = {}, []
    for name in args.methods:
        try:
            if name.endswith("-via-host"):
                verifiers[name] = via_host(get_verifier(name.removesuffix("-via-host")))
                continue
            verifiers[name] = EXTRA_FORMS[name] if name in EXTRA_FORMS else get_verifier(name)
        except (ImportError, AttributeError, ValueError) as exc:
            notes.append(f"- `{name}` skipped: {type(exc).__name__}: {exc}")

    rows = ["| method | V | K | L | mean ms | median ms | p90 ms | x softmax(p) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def row(name: str, vocab: int, num_paths: int, times: list[float], ratio: float) -> str:
        return (f"| {name} | {vocab} | {num_paths} | {args.block_len} | {statistics.fmean(times):.2f} | "
                f"{statistics.median(times):.2f} | {percentile(times, 0.9):.2f} | {ratio:.1f} |")

    goal_ratios = {}  # vocabulary -> gbv's ratio at the goal's K and L (issue 8)
    for vocab in args.vocab:
        for num_paths in args.paths:
            instances = [tuple(t.to(args.device) for t in make_inputs(vocab, num_paths, args.block_len, args.seed + i))
                         for i in range(args.instances)]
            # The yardstick, in the same process and on the same tensors: one softmax over p (K, L+1, V).
            softmax_times = time_method(lambda t, q, p, rng: torch.softmax(p, dim=-1), instances, args.seed,
                                        args.repeats, args.warmup, CLOCKS[args.clock])
            softmax_ms = statistics.fmean(softmax_times)
            rows.append(row("softmax(p)", vocab, num_paths, softmax_times, 1.0))
            for name, verifier in verifiers.items():
                try:
                    times = time_method(verifier, instances, args.seed, args.repeats, args.warmup, CLOCKS[args.clock])
                except Exception as exc:  # a method under construction must not stop the others
                    notes.append(f"- `{name}` failed at V={vocab}, K={num_paths}: {type(exc).__name__}: {exc}")
                    continue
                rows.append(row(name, vocab, num_paths, times, statistics.fmean(times) / softmax_ms))
                if name == "gbv" and (num_paths, args.block_len) == (VERIFY_PATHS, VERIFY_BLOCK):
                    goal_ratios[vocab] = statistics.fmean(times) / softmax_ms
                print(rows[-1], file=sys.stderr, flush=True)
    where = "CPU" if args.device == "cpu" else torch.cuda.get_device_name(torch.device(args.device))
    header = (f"{where}, torch {torch.__version__}, {args.threads} thread(s), float32 inputs, {args.clock} clock, "
              f"{args.instances} random instance(s) per configuration, {args.repeats} timed calls cycling "
              f"through them after {args.warmup} warm-up calls per row; x softmax(p) = ratio of the means"
              + ("; host forms on numpy only (--numpy-only)." if args.numpy_only else "."))
    goals = ["", goals_markdown(verifier_goals(goal_ratios))] if goal_ratios else []
    table = "\n".join([header, "", *rows] + goals + (["", *notes] if notes else [])) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
