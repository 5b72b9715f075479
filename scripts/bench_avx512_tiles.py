"""The panel kernel's AVX-512 tiles against its AVX2 ones (or its two-panel tiles against one-panel
ones), in one process (bundled pair, 1 thread, CPU).

    python scripts/bench_avx512_tiles.py                       # float32, 3 GSM8K + 3 HumanEval prompts
    python scripts/bench_avx512_tiles.py --dtype bfloat16 --prompts 5
    python scripts/bench_avx512_tiles.py --compare one-panel   # AVX-512 tiles of one panel against two
    python scripts/bench_avx512_tiles.py --compare amx --dtype bfloat16   # AVX-512 tiles against AMX

``--compare one-panel``: products of 8 rows or more by AVX-512 tiles of one panel against those of two
(``host_kernels.set_two_panel_tiles``; the same sums, so the same tokens), and the forwards include a
prompt of 64 and of 102 tokens (the prefill's product sizes).

``--compare amx``: the bfloat16 weights' products (a bfloat16 target's, and the draft's bfloat16 view)
by the AVX-512 tiles against the AMX products (``host_kernels.amx_products``; x rounded to bfloat16, so
the tokens differ a little). Both packings of every bf16 weight are kept and swapped in per round, and
the forwards include the prompt sizes too.

Products of 2 rows or more take the AVX-512 tiles where the CPU has AVX-512F (gbv/engine/_host_kernels.c;
``host_kernels.set_avx512_tiles`` switches them, at no cost, so both run in the same process):
1. the target's forward of 1, 2, 5, 9, 13 and 25 queries after a 128-token prefix (the tree mask of a
   chain), medians of 7 rounds of 20 (of 3 for 64 and 102), the two kinds alternating per round;
2. whole generations of ``ar``, BV L = 4 and 8 and the multi-path rows at K = 3, the two kinds
   alternating per prompt (drift hits both alike), T = 0.2 and 1, 128 tokens: pooled tokens/s and
   milliseconds per iteration (the two give the same tokens up to the sums' order: block efficiencies
   are printed to show it).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import gbv
import gbv.engine.host_kernels as host_kernels
from gbv.engine.tree_decoder import lean_model
from prompt_sets import benchmark_prompt_ids

ROWS = (("ar", 1, 1), ("block", 1, 4), ("block", 1, 8), ("gbv", 3, 8), ("gbv-adaptive", 3, 4), ("traversal", 3, 4),
        ("specinfer", 3, 4))
KINDS = {"avx2": ("AVX2", "AVX-512"), "one-panel": ("one panel", "two panels"), "amx": ("AVX-512 tiles", "AMX")}
# per kind of --compare amx: (host forward, its panels in HostForward.products' order) of each model
PACKINGS: dict = {}


def keep_packings(pair) -> None:
    """Both packings of every bfloat16 weight of the pair's lean views (target, and the draft's bf16
    view), for :func:`use` to swap in."""
    from gbv.engine.lean_host import choose_cpu_forward
    from gbv.engine.tree_decoder import draft_lean_model
    views = {id(view): view for view in (lean_model(pair.target), draft_lean_model(pair.draft, pair.target))}
    for view in views.values():
        host = view.host_forward
        if host is None or host.layer_panels is None:
            continue
        for kind, amx in (("AVX-512 tiles", False), ("AMX", True)):
            PACKINGS.setdefault(kind, []).append((host, [
                host_kernels.PanelWeight(product.weight_t, True, amx=amx) if product.panel.bf16 else product.panel
                for product in host.products()]))
        if host_kernels.prefetch_temporal() is None:
            # the prefetch hint, as a process without the AMX products chooses it (AMX products leave
            # it unchosen: lean_host.choose_cpu_forward); the tiles run with it
            host.set_panels(PACKINGS["AVX-512 tiles"][-1][1])
            choose_cpu_forward(view, host)
            host.set_panels(PACKINGS["AMX"][-1][1])
    print(f"prefetch hint: {'temporal' if host_kernels.prefetch_temporal() else 'non-temporal'}")


def use(kind: str) -> None:
    """Switch the kernel to ``kind`` (one of the names in KINDS)."""
    host_kernels.set_avx512_tiles(kind != "AVX2")
    host_kernels.set_two_panel_tiles(kind != "one panel")
    for host, panels in PACKINGS.get(kind, ()):
        host.set_panels(panels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=3, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--compare", default="avx2", choices=sorted(KINDS),
                        help="avx2: AVX2 against AVX-512 tiles (default); one-panel: one- against two-panel "
                             "tiles; amx: the AVX-512 tiles against the AMX products (bfloat16 weights)")
    args = parser.parse_args()
    kinds = KINDS[args.compare]
    torch.set_num_threads(1)
    if host_kernels.host_kernels_unavailable() is not None:
        raise SystemExit(f"bench_avx512_tiles: {host_kernels.host_kernels_unavailable()}")
    try:
        host_kernels.set_avx512_tiles(True)
    except ValueError as error:
        raise SystemExit(f"bench_avx512_tiles: {error}")
    pair = gbv.load_pair("bundled", dtype=args.dtype)
    lean = lean_model(pair.target)
    print(f"{args.dtype}; the target's forward: {lean.forward_choice}")
    if lean.host_forward is None:
        raise SystemExit("bench_avx512_tiles: the target runs without the host forward here: no panel products")
    if args.compare == "amx":
        try:
            host_kernels.set_amx_products(True)
        except ValueError as error:
            raise SystemExit(f"bench_avx512_tiles: {error}")
        keep_packings(pair)

    # 1. Forwards of n queries.
    cache = lean.new_cache(1, 1024)
    sizes = (1, 2, 5, 9, 13, 25) + ((64, 102) if args.compare in ("one-panel", "amx") else ())
    times: dict = {}
    with torch.inference_mode():
        lean.chain(list(range(1, 129)), 0, cache)
        calls = {}
        for n in sizes:
            tokens, positions = torch.full((1, n), 7), torch.arange(128, 128 + n)[None]
            mask = torch.cat([torch.ones(n, 128, dtype=torch.bool), torch.tril(torch.ones(n, n, dtype=torch.bool))],
                             1)[None, None]
            calls[n] = (lambda t=tokens, p=positions, m=mask if n > 1 else None:
                        lean.forward(t, p, 128, cache, m))
        for _ in range(7):
            for kind in kinds:
                use(kind)
                for n in sizes:
                    repeats = 20 if n <= 25 else 3
                    for _ in range(3):
                        calls[n]()
                    began = time.perf_counter()
                    for _ in range(repeats):
                        calls[n]()
                    times.setdefault((kind, n), []).append((time.perf_counter() - began) / repeats * 1e3)
    print(f"| queries | {kinds[0]} ms | {kinds[1]} ms | ratio |\n|---:|---:|---:|---:|")
    for n in sizes:
        a, b = (statistics.median(times[kind, n]) for kind in kinds)
        print(f"| {n} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")

    # 2. Generations.
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    for temperature in (0.2, 1.0):
        totals: dict = {}
        for method, k, length in ROWS:
            gbv.generate(pair, prompt_ids=prompts[0], method=method, num_paths=k, block_len=length, max_new_tokens=16,
                         temperature=temperature, eos_token_id=[])  # warm-up
        for index, ids in enumerate(prompts):
            for method, k, length in ROWS:
                for kind in (kinds if index % 2 == 0 else kinds[::-1]):
                    use(kind)
                    began = time.perf_counter()
                    out = gbv.generate(pair, prompt_ids=ids, method=method, num_paths=k, block_len=length,
                                       max_new_tokens=args.max_new_tokens, temperature=temperature,
                                       eos_token_id=[], seed=index)
                    total = totals.setdefault((method, k, length, kind), [0.0, 0, 0])
                    total[0] += time.perf_counter() - began
                    total[1] += out.stats.new_tokens
                    total[2] += out.stats.target_calls
        print(f"\nT = {temperature}, {len(prompts)} prompts x {args.max_new_tokens} tokens")
        print(f"| row | {kinds[0]} tokens/s | {kinds[1]} tokens/s | ratio | {kinds[0]} ms/it | {kinds[1]} ms/it | ratio "
              "| block efficiency |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for method, k, length in ROWS:
            (sa, ta, ca), (sb, tb, cb) = (totals[method, k, length, kind] for kind in kinds)
            label = "ar" if method == "ar" else f"{method} K={k} L={length}"
            print(f"| {label} | {ta / sa:.0f} | {tb / sb:.0f} | {(tb / sb) / (ta / sa):.3f}x | {1e3 * sa / ca:.2f} | "
                  f"{1e3 * sb / cb:.2f} | {(1e3 * sa / ca) / (1e3 * sb / cb):.3f}x | {ta / ca:.2f} / {tb / cb:.2f} |")
    use(kinds[1])


if __name__ == "__main__":
    main()
