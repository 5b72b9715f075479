"""Host reads (device -> host synchronisations on a GPU) and tensor ops per verify call, for every verifier.

    python scripts/host_reads.py                      # K = 3, L = 8, V = 1000, 40 calls each
    python scripts/host_reads.py --per-coin           # accept() drawing and reading one uniform per coin

Inputs from ``gbv.bench.host_reads.verify_inputs`` (as in tests/engine/test_syncs.py), a fresh
``TorchRandom`` per call (so each call also pays the first read of its block of uniforms; in the
engine the random source lives as long as the sequence). ``--per-coin`` replaces
``TorchRandom.accept`` by the form before the blocks of uniforms (one draw and one read per coin),
for the before/after table in docs/ENGINE.md ("Host reads"). The ops column counts the aten calls a
verify call dispatches (a ``TorchDispatchMode``; views included): on a GPU most are kernel launches, what a
device form pays instead of its host reads.
"""
import argparse

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gbv.bench.host_reads import count_host_reads, verify_inputs
from gbv.verify import METHODS, TorchRandom, get_verifier
from gbv.verify.gbv import verify_gbv_on_device
from gbv.verify.gbv_adaptive import verify_gbv_adaptive_on_device
from gbv.verify.specinfer import verify_specinfer_on_device
from gbv.verify.spectr import verify_spectr_on_device
from gbv.verify.traversal import verify_traversal_on_device


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class PerCoinRandom(TorchRandom):
    """accept() with one uniform drawn and read back per coin (float32, as before ACCEPT_BLOCK)."""

    def _uniform(self) -> float:
        return torch.rand((), generator=self.generator).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", type=int, default=3)
    parser.add_argument("--block-len", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--per-coin", action="store_true", help="one uniform drawn and read per accept()")
    args = parser.parse_args()
    torch.set_num_threads(1)
    source = PerCoinRandom if args.per_coin else TorchRandom
    print(f"| method (K={args.paths}, L={args.block_len}, V={args.vocab}) | host reads per call, mean | max | "
          "aten ops per call, mean |")
    print("|---|---:|---:|---:|")
    rows = [(method, get_verifier(method)) for method in METHODS]
    rows.append(("gbv, device form (on a GPU)", verify_gbv_on_device))
    rows.append(("gbv-adaptive, device form (on a GPU)", verify_gbv_adaptive_on_device))
    rows.append(("specinfer, device form (on a GPU)", verify_specinfer_on_device))
    rows.append(("spectr, device form (on a GPU)", verify_spectr_on_device))
    rows.append(("traversal, device form (on a GPU)", verify_traversal_on_device))
    for method, verifier in rows:
        counts, ops = [], []
        for seed in range(args.calls):
            draft_tokens, q, p = verify_inputs(args.paths, args.block_len, args.vocab, seed)
            rng = source(seed=seed)
            with count_host_reads() as reads:
                verifier(draft_tokens, q, p, rng)
            counts.append(reads["n"])
            with OpCount() as counter:  # the same call again, from the same seed
                verifier(draft_tokens, q, p, source(seed=seed))
            ops.append(counter.n)
        print(f"| {method} | {sum(counts) / len(counts):.1f} | {max(counts)} | {sum(ops) / len(ops):.0f} |")


if __name__ == "__main__":
    main()
