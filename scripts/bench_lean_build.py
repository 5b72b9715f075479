"""How long a lean view of a model of real size takes to build (the fused, transposed and norm-folded copies
a first ``gbv.generate`` makes), for random models built from configurations (no download).

    python scripts/bench_lean_build.py                          # Pythia-410m and SmolLM2-360M shapes
    python scripts/bench_lean_build.py --models pythia-410m --threads 1

Prints the seconds of ``LeanCausalLM(model)`` per model: the first build in a fresh process (what a first
``gbv generate`` pays), in ``--repeats`` processes, and their median. Why fresh processes: a second build in
the same process reuses the memory the first one freed and takes a fraction of the time (most of a first
build is the pages of its copies). The Hugging Face model's own construction (random initialisation here,
loading weights in use) is not counted.
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
from engine_toy import real_size  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="pythia-410m,smollm2-360m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per model (default 3)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # one first build, in this fresh process: prints its seconds
        from gbv.engine.lean import LeanCausalLM

        torch.set_num_threads(args.threads)
        model = real_size(args.worker)
        began = time.perf_counter()
        LeanCausalLM(model)
        print(time.perf_counter() - began, sum(p.numel() for p in model.parameters()))
        return
    for name in args.models.split(","):
        seconds = []
        for _ in range(args.repeats):
            done = subprocess.run([sys.executable, __file__, "--worker", name, "--threads", str(args.threads)],
                                  capture_output=True, text=True, check=True)
            spent, count = done.stdout.split()[-2:]
            seconds.append(float(spent))
        print(f"{name} ({int(count) / 1e6:.0f}M parameters, {args.threads} thread(s)): a first lean view built in "
              f"{statistics.median(seconds):.2f} s (median of {args.repeats} processes: "
              + ", ".join(f"{s:.2f}" for s in seconds) + ")")


if __name__ == "__main__":
    main()
