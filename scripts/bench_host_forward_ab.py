"""The host forward (gbv/engine/lean_host.py), or its panel kernel, on and off in one run.

    python scripts/bench_host_forward_ab.py --prompts 5               # 5 GSM8K + 5 HumanEval prompts
    python scripts/bench_host_forward_ab.py --prompts 4 --batch 8     # batches of 8 rows as well
    python scripts/bench_host_forward_ab.py --switch kernels           # its compiled kernels
    python scripts/bench_host_forward_ab.py --switch bf16              # bfloat16: in float32 or as before
    python scripts/bench_host_forward_ab.py --switch fused --dtype bfloat16   # one-call forward and draw
    python scripts/bench_host_forward_ab.py --switch kernels-before --before f9b8026 --dtype bfloat16
    python scripts/bench_host_forward_ab.py --switch max-rows --dtype bfloat16   # kernels up to 24 rows
    python scripts/bench_host_forward_ab.py --switch kv-cache    # bfloat16 pair: bf16 KV cache or float32

Both variants use the same lean views of the bundled pair. With ``--switch host`` (the default),
"off" sets their ``host_forward`` to None (the torch forward, what ``GBV_HOST_FORWARD=0`` gives); with
``--switch panels``, "off" gives the host forward's products to torch's GEMM (what ``GBV_PANELS=0``
gives). "on" puts it back. With ``--switch bf16`` the pair is loaded twice in bfloat16: "on" runs as the
engine now does (float32 over the bf16 weight values, bf16 panels: ``bf16_weights_in_float32_reason``),
"off" as before (bfloat16 throughout on torch, what ``GBV_HOST_KERNELS=0`` gives). With ``--switch fused``
(``--dtype`` float32 or bfloat16), "off" runs a sequence's host forward one compiled call per layer
and its softmax and draws on torch, as before the sixteenth session; "on" makes the forward one
compiled call and the softmax and draw another. With ``--switch kernels-before --before REV``, "off"
runs the compiled kernels of ``gbv/engine/_host_kernels.c`` as of commit REV (built here with gcc
into a module of another name; its functions must take the same arguments), "on" the installed
ones: a before/after of a change to the C file. With ``--switch max-rows``, "off" gives passes of
more than 24 rows (and prompts of more than 24 tokens) to torch's products and SDPA, as before the
eighteenth session, "on" to the kernels as now. With ``--switch kv-cache`` (the pair in bfloat16),
"off" gives the lean views a float32 KV cache, as before the nineteenth session, "on" the bfloat16
one they now have (``LeanCausalLM.cache_dtype``). For each prompt (and each
batch of prompts) every row runs once per variant, in alternating order, with the same seed, 1
thread, EOS off. Prints pooled tokens/s per row and variant and the ratio on/off; the machine is
shared, so only the ratios within one run mean anything.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from gbv.engine import host_kernels, lean_host, sampling
from gbv.engine.generate import generate
from gbv.engine.tree_decoder import lean_model
from gbv.models.loading import load_pair
from kernels_at import kernels_at
from prompt_sets import benchmark_prompt_ids

ROWS = [("ar", 1, 1), ("block", 1, 2), ("block", 1, 4), ("block", 1, 8), ("gbv", 3, 8)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--batch", type=int, default=0, help="also decode batches of this many rows")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", default="0.2,1.0")
    parser.add_argument("--switch", choices=["host", "kernels", "panels", "attention", "bf16", "fused",
                                             "kernels-before", "max-rows", "kv-cache"],
                        default="host",
                        help="what to turn off: the host forward, or its compiled kernels (both or one); bf16: "
                             "bfloat16 run in float32 against bfloat16 throughout; fused: the one-call forward "
                             "and softmax/draw")
    parser.add_argument("--dtype", default="float32",
                        help="the pair's dtype (--switch fused, kernels-before, max-rows)")
    parser.add_argument("--before", help="the commit whose _host_kernels.c is 'off' (--switch kernels-before)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.switch == "kernels-before":
        if not args.before:
            raise SystemExit("--switch kernels-before needs --before REV (a commit)")
        if host_kernels.host_kernels_unavailable():
            raise SystemExit(f"the compiled kernels do not run here: {host_kernels.host_kernels_unavailable()}")
        kernels = {True: host_kernels._host_kernels, False: kernels_at(args.before)}
        pair = load_pair("bundled", dtype=args.dtype)

        def use_kernels(on: bool) -> None:
            host_kernels._host_kernels = kernels[on]

        run_ab(args, {True: pair, False: pair}, use_kernels)
        return
    if args.switch == "bf16":
        pairs = {True: load_pair("bundled", dtype="bfloat16"), False: load_pair("bundled", dtype="bfloat16")}
        os.environ["GBV_HOST_KERNELS"] = "0"  # only while the "off" pair's lean views are built
        try:
            old = [lean_model(pairs[False].target), lean_model(pairs[False].draft)]
        finally:
            del os.environ["GBV_HOST_KERNELS"]
        new = [lean_model(pairs[True].target), lean_model(pairs[True].draft)]
        if not all(view.bf16_in_float32 for view in new) or any(view.bf16_in_float32 for view in old):
            raise SystemExit("bfloat16 does not run in float32 here (no compiled kernels?)")
        run_ab(args, pairs, lambda on: None)
        return
    if args.switch == "kv-cache":
        pair = load_pair("bundled", dtype="bfloat16")
        views = [lean_model(pair.target), lean_model(pair.draft)]
        if any(view.cache_dtype != torch.bfloat16 for view in views):
            raise SystemExit("the bfloat16 pair has no bfloat16 KV cache here (no compiled kernels?)")

        def use_cache(on: bool) -> None:
            for view in views:
                view.cache_dtype = torch.bfloat16 if on else torch.float32

        run_ab(args, {True: pair, False: pair}, use_cache)
        return
    if args.switch == "max-rows":
        pair = load_pair("bundled", dtype=args.dtype)
        limit, one_call = lean_host.KERNEL_MAX_ROWS, lean_host.HostForward.one_call

        def use_limit(on: bool) -> None:
            lean_host.KERNEL_MAX_ROWS = limit if on else 24
            lean_host.HostForward.one_call = one_call if on else (lambda self, n: n <= 24 and one_call(self, n))

        run_ab(args, {True: pair, False: pair}, use_limit)
        return
    pair = load_pair("bundled", dtype=args.dtype if args.switch == "fused" else "float32")  # (the others: fp32)
    views = [lean_model(pair.target), lean_model(pair.draft)]
    host = [view.host_forward for view in views]
    if any(h is None for h in host):
        raise SystemExit("the bundled pair has no host forward here (GBV_HOST_FORWARD=0 set?)")
    if args.switch == "fused":
        layer_panels = [h.layer_panels for h in host]
        if any(p is None for p in layer_panels):
            raise SystemExit("the compiled kernels do not run here")
        host_softmax = sampling._host_softmax

        def use_fused(on: bool) -> None:
            for forward, panels in zip(host, layer_panels):
                forward.layer_panels = panels if on else None
            sampling._host_softmax = host_softmax if on else (lambda logits, config: False)

        run_ab(args, {True: pair, False: pair}, use_fused)
        return
    kernels = {"kernels": ("panels_off", "attention_off"), "panels": ("panels_off",),
               "attention": ("attention_off",)}.get(args.switch, ())
    reasons = [getattr(h, name) for h in host for name in kernels if getattr(h, name)]
    if reasons:
        raise SystemExit(f"the compiled kernels do not run here: {reasons[0]}")

    def use(on: bool) -> None:
        for view, forward in zip(views, host):
            if args.switch == "host":
                view.host_forward = forward if on else None
            else:
                for name in kernels:
                    setattr(forward, name, None if on else "off for the A/B run")

    run_ab(args, {True: pair, False: pair}, use)


def run_ab(args, pairs: dict, use) -> None:
    """Every row of ``ROWS`` with ``pairs[on]`` after ``use(on)``, on and off alternately per prompt
    (and batch); prints the table."""
    pair = pairs[True]
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    groups = [[p] for p in prompts]
    if args.batch > 1:
        groups += [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    print("| rows | method | T | off tok/s | on tok/s | on/off |")
    print("|---|---|---|---:|---:|---:|")
    for temperature in [float(t) for t in args.temperature.split(",")]:
        settings = dict(temperature=temperature, eos_token_id=[], max_new_tokens=args.max_new_tokens)
        for each in pairs.values():
            generate(each, prompt_ids=prompts[0], method="gbv", num_paths=3, block_len=4, **{**settings,
                     "max_new_tokens": 16})  # warm-up
        totals = {}
        for index, group in enumerate(groups):
            for on in ((False, True) if index % 2 == 0 else (True, False)):
                use(on)
                for method, k, length in ROWS:
                    start = time.perf_counter()
                    pair = pairs[on]
                    if len(group) == 1:
                        outs = [generate(pair, prompt_ids=group[0], method=method, num_paths=k, block_len=length,
                                         seed=index, **settings)]
                    else:
                        outs = generate(pair, prompt_ids=group, method=method, num_paths=k, block_len=length,
                                        seed=index, batch_size=len(group), **settings)
                    seconds = time.perf_counter() - start
                    key = (len(group), method, k, length, on)
                    made = sum(len(out.token_ids) for out in outs)
                    tokens, total = totals.get(key, (0, 0.0))
                    totals[key] = (tokens + made, total + seconds)
        use(True)
        for size in sorted({len(g) for g in groups}):
            for method, k, length in ROWS:
                rate = {on: totals[size, method, k, length, on][0] / totals[size, method, k, length, on][1]
                        for on in (False, True)}
                name = f"{method} K={k} L={length}" if method != "ar" else "ar"
                print(f"| {size} | {name} | {temperature} | {rate[False]:.1f} | {rate[True]:.1f} | "
                      f"{rate[True] / rate[False]:.3f}x |")


if __name__ == "__main__":
    main()
