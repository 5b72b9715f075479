"""The products' threads with and without the pool's verdict (_host_kernels.c, pool_judge), and on one thread, in
one process, with other processes spinning on the CPU (a machine shared with other work) or without.

    python scripts/bench_pool_verdict.py --pair smollm2 --dtype bfloat16 --busy 1
    python scripts/bench_pool_verdict.py --pair pythia-small --busy 1 --rounds 6
    python scripts/bench_pool_verdict.py --pair pythia --busy 0

Random pairs of real shapes (``engine_toy.REAL_PAIRS``; no download), torch at gbv's default threads for the
target (``apply_threads``). Three settings of the compiled products, in turn within each round:

- ``verdict``: on every core, with the verdict (the default): where a window of split products took longer
  than the caller's estimate of running them alone, the next ones run alone for a while;
- ``always``: on every core, never judged (what the code did before the verdict);
- ``one``: on one thread.

Each setting runs ``ar`` and BV L = 4 on one 64-token prompt (T = 1, 32 new tokens, EOS off, the round's
seed), after one untimed call that builds the lean views; tokens/s are medians over ``--rounds``. The verdicts
against the threads each setting's calls made are counted too.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
from engine_toy import REAL_PAIRS as PAIRS, real_size  # noqa: E402

SETTINGS = ("verdict", "always", "one")
METHODS = ("ar", "block")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=PAIRS, default="smollm2")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--busy", type=int, default=1, help="other processes spinning on the CPU meanwhile")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    import gbv
    from gbv.engine import host_kernels
    from gbv.engine.threads import apply_threads
    from gbv.models.loading import ModelPair

    kernels = host_kernels._host_kernels
    names = PAIRS[args.pair]
    dtype = getattr(torch, args.dtype)
    target, draft = real_size(names[0]).to(dtype), real_size(names[1]).to(dtype)
    pair = ModelPair(target, draft)
    apply_threads(None, target, draft)
    every = host_kernels.product_threads()
    ids = list(range(100, 164))

    def run(method: str, seed: int, tokens: int) -> float:
        began = time.perf_counter()
        made = len(gbv.generate(pair, prompt_ids=ids, method=method, block_len=4, max_new_tokens=tokens, seed=seed,
                                eos_token_id=[]).token_ids)
        return made / (time.perf_counter() - began)

    run("block", 0, 8)  # (builds the lean views)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    rates: dict[tuple[str, str], list[float]] = {(s, m): [] for s in SETTINGS for m in METHODS}
    verdicts = {setting: 0 for setting in SETTINGS}
    try:
        for round_ in range(args.rounds):
            for setting in SETTINGS:
                host_kernels.set_product_threads(1 if setting == "one" else every)
                kernels.set_pool_verdict(1.0 if setting == "verdict" else 1e9, 64)
                for method in METHODS:
                    against = kernels.pool_verdicts()[0]
                    rates[setting, method].append(run(method, round_, args.max_new_tokens))
                    verdicts[setting] += kernels.pool_verdicts()[0] - against
    finally:
        for process in busy:
            process.kill()
        kernels.set_pool_verdict(1.0, 64)
        host_kernels.set_product_threads(every)
    print(f"{names[0]} / {names[1]} shapes (random), {args.dtype}, torch on {torch.get_num_threads()} thread(s), "
          f"the products on {every} (or 1), {args.busy} other process(es) spinning, {args.max_new_tokens} new "
          f"tokens, medians of {args.rounds} rounds (gbv from {Path(gbv.__file__).parent})\n")
    print("| setting | `ar` tokens/s | BV L = 4 tokens/s | vs `one`: `ar` / BV | verdicts against the threads |")
    print("|---|---:|---:|---:|---:|")
    median = {key: statistics.median(values) for key, values in rates.items()}
    for setting in SETTINGS:
        ar, block = median[setting, "ar"], median[setting, "block"]
        print(f"| {setting} | {ar:.1f} | {block:.1f} | {ar / median['one', 'ar']:.2f}x / "
              f"{block / median['one', 'block']:.2f}x | {verdicts[setting]} |")


if __name__ == "__main__":
    main()
