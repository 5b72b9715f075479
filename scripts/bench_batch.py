"""Batched decoding (``generate(prompts=..., batch_size=B)``, the scheduler behind ``gbv serve``): every
row against ``ar`` at each batch size, in one process, bundled pair, 1 thread.

    python scripts/bench_batch.py --dtype bfloat16 --temperature 1.0
    python scripts/bench_batch.py --batch-sizes 1,4,16 --prompts 32 --rounds 3 --rows ar,block:2,block:4,auto
    python scripts/bench_batch.py --rows ar,block:2,block:4 --batch-layers on,off   # the batch layer calls A/B
    python scripts/bench_batch.py --rows ar,block:4,gbv:3:8 --batch-max-rows on,off   # kernels past 64 rows A/B

Each round runs every (row, batch size) over the same ``--prompts`` GSM8K prompts (seeds 0.., EOS off,
``--max-new-tokens``), the rows in a rotating order. ``auto``'s policies live as long as the process,
one per batch size (rounded up to a power of 2), as in a server: the first round includes their
exploration, and the table shows the first round and the later ones apart. Reported per batch size:
each row's pooled tokens/s and its ratio to ``ar``, and ``auto`` against the best fixed row.
``--batch-layers on,off`` also runs every cell with several sequences' layers as one compiled call
(``lean_host.BATCH_LAYERS``, the default) and as a call per product and per sequence's attention (the
form before), interleaved, and prints each row's on / off ratio (leave ``auto`` out there: its policy
would learn from both forms). ``--batch-max-rows on,off`` does the same for the compiled kernels on a
batch of any rows in all (``lean_host.BATCH_MAX_ROWS = None``, the default) against the cap of 64
rows in all that stood before the thirty-third session (larger passes on torch's products and SDPA).
One of the two switches at a time takes both forms.
"""
from __future__ import annotations

import argparse
import time

import torch

import gbv
from gbv.data import load_prompts

from bench_rev_ab import parse_row  # scripts/ is on the path when run as a script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--rows", default="ar,block:2,block:4,auto")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-layers", default="on", help="on, off or on,off (see above)")
    parser.add_argument("--batch-max-rows", default="on", help="on, off or on,off (see above)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda (scripts/gpu_check.sh, part batch)")
    args = parser.parse_args()
    import gbv.engine.lean_host as lean_host
    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", device=args.device, dtype=getattr(torch, args.dtype))
    prompts = load_prompts("gsm8k", args.prompts)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = args.rows.split(",")
    switches = {"--batch-layers": args.batch_layers.split(","), "--batch-max-rows": args.batch_max_rows.split(",")}
    for name, given in switches.items():
        if not set(given) <= {"on", "off"} or len(given) != len(set(given)):
            parser.error(f"{name} takes on, off or on,off, not {','.join(given)!r}")
    switched = [name for name, given in switches.items() if len(given) == 2]
    if len(switched) > 1:
        parser.error("give both forms (on,off) to one switch at a time")
    forms = switches[switched[0]] if switched else ["on"]

    def use_form(form: str) -> None:
        """The settings of this form: the switched one as ``form``, the other as given."""
        chosen = {name: form if name in switched else given[0] for name, given in switches.items()}
        lean_host.BATCH_LAYERS = chosen["--batch-layers"] == "on"
        lean_host.BATCH_MAX_ROWS = None if chosen["--batch-max-rows"] == "on" else 64
    cells = [(row, size) for size in sizes for row in rows]
    seconds: dict = {}
    tokens: dict = {}
    common = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens, eos_token_id=[])
    with torch.inference_mode():  # (warm-up: the lean views and kernels, not auto's policies)
        gbv.generate(pair, prompt=prompts[0], method="ar", max_new_tokens=8)
    for round_ in range(args.rounds):
        # The cells in a rotating order, and a cell's two forms in turns: the first of a pair ran
        # 5-15% slower than the second in one test (`ar` at 16 rows, which no switch touches).
        order = cells[round_ % len(cells):] + cells[:round_ % len(cells)]
        turns = forms if round_ % 2 == 0 else forms[::-1]
        for row, size, form in [(row, size, form) for row, size in order for form in turns]:
            use_form(form)
            began = time.perf_counter()
            if size == 1:
                made = sum(gbv.generate(pair, prompt=p, seed=i, **parse_row(row), **common).stats.new_tokens
                           for i, p in enumerate(prompts))
            else:
                outs = gbv.generate(pair, prompts=prompts, batch_size=size, seed=0, **parse_row(row), **common)
                made = sum(out.stats.new_tokens for out in outs)
            phase = "first" if round_ == 0 else "later"
            key = (row, size, phase, form)
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - began
            tokens[key] = tokens.get(key, 0) + made
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    lean_host.BATCH_LAYERS, lean_host.BATCH_MAX_ROWS = True, None
    if switched:
        print(f"\n{switched[0]} on / off, tokens/s (all rounds):")
        for size in sizes:
            for row in rows:
                on, off = (sum(tokens[row, size, p, f] for p in ("first", "later") if (row, size, p, f) in tokens)
                           / sum(seconds[row, size, p, f] for p in ("first", "later") if (row, size, p, f) in seconds)
                           for f in ("on", "off"))
                print(f"| {size} | {row} | {on:.0f} | {off:.0f} | {on / off:.3f}x |")
    forms_key = forms[0]
    tokens = {key[:3]: value for key, value in tokens.items() if key[3] == forms_key}
    seconds = {key[:3]: value for key, value in seconds.items() if key[3] == forms_key}
    print(f"\nbundled pair, {args.dtype}, T = {args.temperature}, {len(prompts)} GSM8K prompts x "
          f"{args.max_new_tokens} tokens, 1 thread, {args.rounds} rounds (the first apart: auto's exploration)")
    phases = ["first"] + (["later"] if args.rounds > 1 else [])
    print("| batch | row | " + " | ".join(f"{p} round{'s' if p == 'later' else ''}: tokens/s, vs ar" for p in phases)
          + " |")
    print("|---:|---|" + "---|" * len(phases))
    for size in sizes:
        for row in rows:
            parts = []
            for phase in phases:
                rate = tokens[row, size, phase] / seconds[row, size, phase]
                ar = tokens["ar", size, phase] / seconds["ar", size, phase] if "ar" in rows else rate
                parts.append(f"{rate:.0f}, {rate / ar:.2f}x")
            print(f"| {size} | {row} | " + " | ".join(parts) + " |")
    if "auto" in rows:
        for phase in phases:
            line = []
            for size in sizes:
                fixed = {row: tokens[row, size, phase] / seconds[row, size, phase] for row in rows if row != "auto"}
                best = max(fixed, key=fixed.get)
                auto = tokens["auto", size, phase] / seconds["auto", size, phase]
                line.append(f"batch {size}: {auto / fixed[best]:.3f}x {best}")
            print(f"auto against the best fixed row ({phase}): " + "; ".join(line))


if __name__ == "__main__":
    main()
