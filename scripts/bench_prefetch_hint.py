"""The compiled kernels' two prefetch hints against each other, in one process, bundled pair: a target
step, a target step followed by a draft step (as decoding alternates them) and a 5-token target pass,
with the panel kernel prefetching its weights non-temporally (``_MM_HINT_NTA``, its default) and into
every cache level (``_MM_HINT_T0``; ``host_kernels.set_prefetch_temporal``).

    python scripts/bench_prefetch_hint.py                  # float32, 1 thread
    python scripts/bench_prefetch_hint.py --dtype bfloat16

The host forward with its compiled products is kept (``GBV_HOST_FORWARD=1``). Rounds alternate the
hints; each measurement is the median of a round's runs of back-to-back calls, as decoding makes them.
"""
from __future__ import annotations

import argparse
import os

os.environ["GBV_HOST_FORWARD"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import gbv  # noqa: E402
import gbv.engine.host_kernels as host_kernels  # noqa: E402
from gbv.engine.lean import LeanCausalLM  # noqa: E402

from bench_engine import _median_ms  # noqa: E402  (scripts/ is on the path when run as a script)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    unavailable = host_kernels.host_kernels_unavailable()
    if unavailable is not None:
        raise SystemExit(f"bench_prefetch_hint: the compiled kernels do not run here ({unavailable})")
    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", dtype=getattr(torch, args.dtype))
    target, draft = LeanCausalLM(pair.target), LeanCausalLM(pair.draft)
    caches = [target.new_cache(1, 512), draft.new_cache(1, 512)]
    one, at = torch.tensor([[7]]), torch.tensor([[128]])
    five, five_at = torch.arange(5)[None], 128 + torch.arange(5)[None]
    five_mask = torch.ones(1, 1, 5, 133, dtype=torch.bool)
    calls = {
        "target step": lambda: target.forward(one, at, 128, caches[0], None),
        "target + draft step": lambda: (target.forward(one, at, 128, caches[0], None),
                                        draft.forward(one, at, 128, caches[1], None)),
        "target 5-token pass": lambda: target.forward(five, five_at, 128, caches[0], five_mask),
    }
    times: dict = {(name, temporal): [] for name in calls for temporal in (False, True)}
    with torch.inference_mode():
        for lean, cache in ((target, caches[0]), (draft, caches[1])):
            lean.forward(torch.arange(128)[None] % 100, torch.arange(128)[None], 0, cache, None, causal=True)
        for round_ in range(args.rounds):
            for temporal in ((False, True) if round_ % 2 == 0 else (True, False)):
                host_kernels.set_prefetch_temporal(temporal, chosen=False)
                for name, call in calls.items():
                    for _ in range(2):  # (warm, with _median_ms's own first call: the weights where the
                        call()          # last call of this kind left them)
                    times[(name, temporal)].append(_median_ms(call, 10, inner=1))
    host_kernels.set_prefetch_temporal(False, chosen=False)
    print(f"{args.dtype}, {args.rounds} rounds, medians (ms)")
    print("| call | non-temporal (NTA) | temporal (T0) | NTA / T0 |\n|---|---:|---:|---:|")
    for name in calls:
        nta, t0 = (float(np.median(times[(name, temporal)])) for temporal in (False, True))
        print(f"| {name} | {nta:.3f} | {t0:.3f} | {nta / t0:.2f}x |")


if __name__ == "__main__":
    main()
