"""The compiled host kernels (gbv/engine/host_kernels.py) against what they replace, in one run.

    python scripts/bench_host_kernels.py                   # ~1 min, 1 thread, bundled pair
    python scripts/bench_host_kernels.py --before f9b8026  # tables 1 and 5 also with the C file of a commit

Four tables, medians over repeats (the machine is shared: compare within a table only):
1. the bundled target's matrix products (every layer's fused q/k/v, o, gate/up, down, and the LM head)
   for M rows: ``x @ W_t`` through torch (MKL) against the panel kernel, with float32 panels and with
   bfloat16 panels of the same matrices rounded to bf16 (what a bfloat16 model runs: half the bytes),
   and where the CPU has AMX-BF16 the AMX products of those (which round x to bf16: what a bfloat16
   model runs there);
2. attention of n queries over a 150-slot cache (8 heads of 32, like the bundled models): SDPA
   against the kernel;
3. one draw per row at V = 4096: ``draw_rows`` against the compiled draw;
4. whole forwards of the lean models over a 128-token prefix (and prompts of 100 and 200 tokens from
   slot 0): the host forward with its kernels
   against the same forward with torch's products and SDPA (what ``GBV_HOST_KERNELS=0`` gives);
5. the panel kernel's arithmetic rate by rows, on a (256, 512) weight that stays in the L2 cache
   (GFLOP/s; compare with the core's rate of fused multiply-adds, ``scripts/fma_peak.c``).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from gbv.engine import host_kernels
from gbv.engine.host_kernels import PanelWeight, attention_into, draw_rows_host, host_kernels_unavailable
from gbv.engine.tree import prefix_then
from gbv.engine.tree_decoder import lean_model
from gbv.models.loading import load_pair
from gbv.verify.common import draw_rows
from kernels_at import kernels_at


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--before", help="tables 1 and 5 also with the kernels of _host_kernels.c at this commit")
    args = parser.parse_args(argv)
    reason = host_kernels_unavailable()
    if reason is not None:
        raise SystemExit(f"the compiled kernels do not run here: {reason}")
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype="float32")
    target, draft = lean_model(pair.target), lean_model(pair.draft)
    host = target.host_forward
    products = [product for layer in host.layers for product in (layer[0], layer[2], layer[3], layer[4])]
    products.append(host.lm_head)
    megabytes = sum(p.weight_t.numel() for p in products) * 4 / 1e6
    rng = np.random.default_rng(0)

    bf16_panels = [PanelWeight(p.weight_t.to(torch.bfloat16).float(), bf16=True, amx=False) for p in products]
    # the same bf16 weights for the AMX products (x rounded to bf16), where they run
    amx = host_kernels._host_kernels.amx()
    amx_panels = [PanelWeight(p.weight_t.to(torch.bfloat16).float(), bf16=True, amx=True)
                  for p in products] if amx else []
    now = host_kernels._host_kernels
    before = kernels_at(args.before) if args.before else None
    print(f"1. Target matrix products ({megabytes:.1f} MB of weights in float32), ms\n")
    extra = f" panel kernel ({args.before}) | bf16 panels ({args.before}) |" if before else ""
    extra += " AMX (bf16 x) | bf16 panels / AMX |" if amx else ""
    print(f"| rows | torch (MKL) | panel kernel | ratio | bf16 panels | fp32 / bf16 panels |{extra}\n"
          f"|---:|---:|---:|---:|---:|---:|{'---:|---:|' if before else ''}{'---:|---:|' if amx else ''}")
    for rows in (1, 2, 3, 5, 9, 13, 17, 25, 64, 102):
        xs = [rng.standard_normal((rows, p.weight_t.shape[0])).astype(np.float32) for p in products]
        ys = [np.zeros((rows, p.weight_t.shape[1]), np.float32) for p in products]
        xt = [torch.from_numpy(x) for x in xs]
        mkl = median_ms(lambda: [x @ p.weight_t for x, p in zip(xt, products)], args.repeats)
        times = {}
        for name, module in (("before", before), ("now", now)):
            if module is None:
                continue
            host_kernels._host_kernels = module
            times[name] = (
                median_ms(lambda: [p.panel.matmul_into(x, y) for x, y, p in zip(xs, ys, products)], args.repeats),
                median_ms(lambda: [p.matmul_into(x, y) for x, y, p in zip(xs, ys, bf16_panels)], args.repeats))
        host_kernels._host_kernels = now
        panel, half = times["now"]
        previous = f" {times['before'][0]:.2f} | {times['before'][1]:.2f} |" if before else ""
        if amx:
            tiles = median_ms(lambda: [p.matmul_into(x, y) for x, y, p in zip(xs, ys, amx_panels)], args.repeats)
            previous += f" {tiles:.2f} | {half / tiles:.2f}x |"
        print(f"| {rows} | {mkl:.2f} | {panel:.2f} | {mkl / panel:.2f}x | {half:.2f} | {panel / half:.2f}x |{previous}")

    print("\n2. Attention over 150 cached slots + n new (8 heads of 32), us\n")
    print("| queries | mask | SDPA | kernel | ratio |\n|---:|---|---:|---:|---:|")
    heads, head_dim, start = 8, 32, 150
    for n, masked in ((1, False), (5, False), (5, True), (12, True), (25, True)):
        end = start + n
        keys = rng.standard_normal((heads, 512, head_dim)).astype(np.float32)
        values = rng.standard_normal((heads, 512, head_dim)).astype(np.float32)
        qkv = rng.standard_normal((n, 3 * heads * head_dim)).astype(np.float32)
        out = np.zeros((n, heads * head_dim), np.float32)
        ancestors = torch.tril(torch.ones(n, n, dtype=torch.bool))
        mask = prefix_then(ancestors, start)[0, 0] if masked else None
        kernel_mask = None if mask is None else np.ascontiguousarray(mask.numpy())
        query = torch.from_numpy(qkv[:, :heads * head_dim].reshape(n, heads, head_dim).transpose(1, 0, 2).copy())[None]
        k, v = torch.from_numpy(keys[None, :, :end]), torch.from_numpy(values[None, :, :end])
        sdpa_mask = None if n == 1 else prefix_then(ancestors, start)
        sdpa = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=sdpa_mask),
                         args.repeats * 10)
        kernel = median_ms(lambda: attention_into(qkv, keys, values, out, kernel_mask, heads, start, end,
                                                  head_dim ** -0.5), args.repeats * 10)
        print(f"| {n} | {'tree' if masked else 'chain'} | {sdpa * 1e3:.0f} | {kernel * 1e3:.0f} | {sdpa / kernel:.2f}x |")

    print("\n3. One inverse-CDF draw per row, V = 4096, us\n")
    print("| rows | draw_rows | compiled | ratio |\n|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 3):
        probs = torch.softmax(torch.randn(rows, 4096), -1)
        plain = median_ms(lambda: draw_rows(probs, generator), args.repeats * 10)
        compiled = median_ms(lambda: draw_rows_host(probs, generator), args.repeats * 10)
        print(f"| {rows} | {plain * 1e3:.0f} | {compiled * 1e3:.0f} | {plain / compiled:.2f}x |")

    print("\n4. Whole forwards over a 128-token prefix, ms (kernels off: torch's products and SDPA)\n")
    print("| model | new tokens | kernels off | kernels on | ratio |\n|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name, lean in (("draft", draft), ("target", target)):
            cache = lean.new_cache(1, 512)
            prefix = 128
            lean.forward(torch.arange(prefix)[None] % 100, torch.arange(prefix)[None], 0, cache, None, causal=True)
            for n in (1, 2, 5, 9, 13, 25, 33, 64, "prompt 100", "prompt 200"):
                if isinstance(n, str):  # a prompt's causal chain from slot 0 (a prefill)
                    length = int(n.split()[1])
                    tokens = torch.arange(length)[None] % 100

                    def run():
                        lean.forward(tokens, torch.arange(length)[None], 0, cache, None, causal=True)
                else:
                    tokens = torch.full((1, n), 7)
                    positions = prefix + torch.arange(n)[None]
                    mask = prefix_then(torch.tril(torch.ones(n, n, dtype=torch.bool)), prefix)

                    def run():
                        lean.forward(tokens, positions, prefix, cache, mask if n > 1 else None)

                forward = lean.host_forward
                times = {}
                for on in (False, True, False, True):  # alternating, the median of each kept
                    forward.panels_off = forward.attention_off = None if on else "off for the A/B run"
                    times.setdefault(on, []).append(median_ms(run, args.repeats))
                forward.panels_off = forward.attention_off = None
                off, on = min(times[False]), min(times[True])
                print(f"| {name} | {n} | {off:.2f} | {on:.2f} | {off / on:.2f}x |")

    print("\n5. The panel kernel in cache: a (256, 512) weight, GFLOP/s\n")
    variants = {"": now}
    if before:
        variants = {f" ({args.before})": before, " (now)": now}
    names = [f"{kind}{label}" for kind in ("float32 panels", "bf16 panels") for label in variants]
    print(f"| rows | {' | '.join(names)} |\n|---:|{'---:|' * len(names)}")
    weight = torch.from_numpy(rng.standard_normal((256, 512)).astype(np.float32)).to(torch.bfloat16).float()
    panels = {False: PanelWeight(weight), True: PanelWeight(weight, bf16=True, amx=False)}
    for rows in (1, 2, 3, 4, 5, 6, 12, 24):
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        y = np.zeros((rows, 512), np.float32)
        rates = []
        for bf16 in (False, True):
            for module in variants.values():
                host_kernels._host_kernels = module

                def run(panel=panels[bf16]):
                    for _ in range(20):
                        panel.matmul_into(x, y)
                rates.append(20 * 2 * rows * 256 * 512 / (median_ms(run, args.repeats) * 1e-3) / 1e9)
        host_kernels._host_kernels = now
        print(f"| {rows} | {' | '.join(f'{rate:.1f}' for rate in rates)} |")



if __name__ == "__main__":
    main()
