"""The first call on a pair of real size: what a user waits for before the first token, in a fresh process.

    python scripts/bench_first_call.py                                  # Pythia-410m / 70m shapes, float32
    python scripts/bench_first_call.py --pair smollm2 --dtype bfloat16
    PYTHONPATH=/path/to/an/older/checkout python scripts/bench_first_call.py   # the same for another revision
    python scripts/bench_first_call.py --profile 25                     # where the first call's time goes

Random models of real shapes (``engine_toy.real_size``, no download; the pairs ``engine_toy.REAL_PAIRS``),
built before the clock starts. Timed: ``apply_threads`` at the default threads (what ``gbv generate`` calls
after loading; past 100M parameters it builds the target's lean view to choose the threads), then the first
``generate`` (BV L = 4, one 64-token prompt, 16 new tokens: the draft's lean views, the forward choices and
the prompt's prefill) and a second, equal one (the steady cost). The lean views copy and pack the weights
(docs/ENGINE.md, "The compiled forward on several threads"), so the first call costs seconds at these sizes.
``--profile N``: ``apply_threads`` and the first call under cProfile, then its N costliest functions by their
own time and by the time under them (the clock then includes the profiler's cost).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
from engine_toy import REAL_PAIRS as PAIRS, real_size  # noqa: E402



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=PAIRS, default="pythia")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the first call and print its N costliest functions")
    args = parser.parse_args()
    import gbv
    from gbv.engine.threads import apply_threads
    from gbv.models.loading import ModelPair

    names = PAIRS[args.pair]
    dtype = getattr(torch, args.dtype)
    target, draft = real_size(names[0]).to(dtype), real_size(names[1]).to(dtype)
    pair = ModelPair(target, draft)
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    began = time.perf_counter()
    try:
        apply_threads(None, target, draft)
    except TypeError:  # (an older gbv's apply_threads takes no draft)
        apply_threads(None, target)
    threads_s = time.perf_counter() - began
    calls = []
    for _ in range(2):
        began = time.perf_counter()
        gbv.generate(pair, prompt_ids=list(range(100, 164)), method="block", block_len=4, max_new_tokens=16, seed=0,
                     eos_token_id=[])
        calls.append(time.perf_counter() - began)
        if profile is not None and len(calls) == 1:
            profile.disable()
    print(f"{names[0]} / {names[1]} shapes, {args.dtype} (gbv from {Path(gbv.__file__).parent}): apply_threads "
          f"{threads_s:.1f} s, first generate {calls[0]:.1f} s, so {threads_s + calls[0]:.1f} s to the first 16 "
          f"tokens; a second generate {calls[1]:.2f} s")
    if profile is not None:
        import pstats

        for order in ("tottime", "cumulative"):
            print(f"\nthe first call's {args.profile} costliest functions by {order}:")
            pstats.Stats(profile, stream=sys.stdout).strip_dirs().sort_stats(order).print_stats(args.profile)


if __name__ == "__main__":
    main()
