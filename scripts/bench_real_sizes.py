"""The engine on models of real sizes (random weights: no download), against transformers, in one process.

    python scripts/bench_real_sizes.py                 # Pythia-410m / Pythia-70m shapes, default threads
    python scripts/bench_real_sizes.py --threads 1 --rounds 3
    python scripts/bench_real_sizes.py --pair smollm2 --dtype bfloat16
    python scripts/bench_real_sizes.py --pair smollm2 --dtype bfloat16 --busy 1 --rows ar,block:4,hf-plain
    python scripts/bench_real_sizes.py --pair gemma3 --dtype bfloat16 --rows block:4,auto --rounds 6 --per-round

The pythia pair is a random GPT-NeoX target of Pythia-410m's shape (24 layers, hidden 1,024, 405M parameters)
and a draft of Pythia-70m's (6 layers, hidden 512), both with the 50k vocabulary; the smollm2 pair a random
Llama target of SmolLM2-360M's shape (32 layers, hidden 960, 362M parameters) and a draft of SmolLM2-135M's (30
layers, hidden 576), both with the 49k vocabulary; the pythia-small pair Pythia-70m's and Pythia-14m's shapes;
the gemma3 pair Gemma-3-1B's and Gemma-3-270M's (Gemma 3, the 262k vocabulary) (``--dtype bfloat16``: both in
bfloat16, as such checkpoints are published; ``--dtype float16`` as Pythia's are). ``--per-round``: each round's tokens/s too, the first one's
included, and the iterations of each (method, K, L) ``auto`` chose in it. ``--busy N`` keeps N other processes
spinning on the CPU for the whole run (each holds a core: a machine shared with other work), ``--rows`` picks
rows. With ``--threads auto`` the peers (transformers' rows) run on torch's default count, which is what a
transformers user gets, and gbv's rows on gbv's default for the target. Their weights are random, so only
``ar`` against ``hf-plain`` compares the engines alone; BV L = 4 and assisted generation run the same pair with
whatever agreement random models have. Each round runs every row once on the same 64-token
prompt (T = 1, 48 new tokens, EOS off); the first round, which builds the lean views (the fused copies of a
405M model take seconds), is not counted; tokens/s are medians over the other rounds. At these sizes a
step reads its weights from memory, so the engine's savings on per-call overhead matter less than on the
bundled pair (docs/ENGINE.md, "The compiled host forward for the LayerNorm families").
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



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="auto",
                        help="torch's and the products' threads, or auto: gbv's default for the target (default)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, the first not counted (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--pair", choices=PAIRS, default="pythia")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--busy", type=int, default=0, help="other processes spinning on the CPU meanwhile")
    parser.add_argument("--rows", default="ar,block:4,hf-plain,hf-assisted")
    parser.add_argument("--per-round", action="store_true",
                        help="print each round's tokens/s and auto's choices as it goes")
    args = parser.parse_args()
    import gbv
    from gbv.models.loading import ModelPair

    from gbv.engine.threads import apply_threads
    try:
        from gbv.engine.host_kernels import product_threads
    except ImportError:  # (an older gbv on PYTHONPATH, for a before/after run: no threads in its products)
        def product_threads() -> int:
            return 1

    names = PAIRS[args.pair]
    dtype = getattr(torch, args.dtype)
    target, draft = real_size(names[0]).to(dtype), real_size(names[1]).to(dtype)
    count = args.threads if args.threads == "auto" else int(args.threads)
    torch_default = torch.get_num_threads()  # (the peers run with what a transformers user gets, or --threads N)
    try:
        apply_threads(count, target, draft)
    except TypeError:  # (an older gbv's apply_threads takes no draft)
        apply_threads(count, target)
    ours = torch.get_num_threads()
    peer_threads = torch_default if args.threads == "auto" else ours
    threads = f"{ours} torch thread(s), {product_threads()} for the products, the peers on {peer_threads}"
    pair = ModelPair(target, draft, tokenizer=gbv.load_pair("bundled").tokenizer)
    ids = list(range(100, 164))
    new = args.max_new_tokens
    names_of = {"ar": "ar", "block:4": "block L=4", "auto": "auto", "hf-plain": "hf-plain", "hf-assisted": "hf-assisted"}
    unknown = [row for row in args.rows.split(",") if row not in names_of]
    if unknown:
        raise SystemExit(f"bench_real_sizes: no row {unknown[0]!r}; the rows are: {', '.join(names_of)}")
    rows = {names_of[row]: None for row in args.rows.split(",")}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        rates: dict[str, list[float]] = {row: [] for row in rows}
        for round_ in range(args.rounds):
            for row in rows:
                began = time.perf_counter()
                torch.set_num_threads(peer_threads if row.startswith("hf") else ours)
                if row.startswith("hf"):
                    extra = dict(assistant_model=draft) if row == "hf-assisted" else {}
                    with torch.inference_mode():
                        out = target.generate(torch.tensor([ids]), do_sample=True, temperature=1.0, max_new_tokens=new,
                                              min_new_tokens=new, pad_token_id=0, **extra)
                    made = out.shape[1] - len(ids)
                else:
                    method = row if row in ("ar", "auto") else "block"
                    result = gbv.generate(pair, prompt_ids=ids, method=method, block_len=4, temperature=1.0,
                                          max_new_tokens=new, seed=round_, eos_token_id=[])
                    made = len(result.token_ids)
                rate = made / (time.perf_counter() - began)
                if args.per_round:
                    arms = result.stats.to_dict().get("auto_arms") if row == "auto" else None
                    print(f"round {round_}: {row} {rate:.1f} tokens/s" + (f", auto's arms {arms}" if arms else ""),
                          flush=True)
                if round_ > 0:
                    rates[row].append(rate)
    finally:
        for process in busy:
            process.kill()
    median = {row: statistics.median(values) for row, values in rates.items()}
    print(f"{names[0]} / {names[1]} shapes (random), {args.dtype}, {threads} ({args.threads}), {new} new tokens, "
          f"medians of {args.rounds - 1} rounds, {args.busy} other process(es) spinning "
          f"(gbv from {Path(gbv.__file__).parent})\n")
    peers = [peer for peer in ("hf-plain", "hf-assisted") if peer in median]
    print("| row | tokens/s |" + "".join(f" vs {peer} |" for peer in peers) + "\n|---|---:|" + "---:|" * len(peers))
    for row, rate in median.items():
        print(f"| {row} | {rate:.1f} |" + "".join(f" {rate / median[peer]:.2f}x |" for peer in peers))


if __name__ == "__main__":
    main()
