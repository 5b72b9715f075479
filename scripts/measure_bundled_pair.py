#!/usr/bin/env python3
"""Measure the bundled target/draft pair for its model card (``gbv/models/bundled/README.md``).

* decode-step time of each model on CPU: batch 1, a cached prefix of ``--prefix`` tokens, one
  thread, median over ``--repeats`` single-token steps (the cache is cropped back after each);
* expected token-level acceptance rate at temperature T: for ``--prompts`` prompts per data set,
  sample ``--new-tokens`` tokens from the target at temperature T, then at each generated position
  compute ``sum_x min(p_T(x), q_T(x))`` from both models' softmax at temperature T; the reported
  number is the mean over all generated positions;
* optionally (``--block-efficiency``) the block efficiency (new tokens / target calls, summed over
  ``--be-prompts`` prompts per data set) of gbv's ``--methods`` (default ``block``, one path, and
  ``gbv``, ``--K`` paths; single-path methods always run with K = 1) with block length ``--L``,
  through ``gbv.load_pair`` / ``gbv.generate`` (the bundled pair, or ``--dir``'s target/draft).

* optionally (``--engine-timing``) the same decode-step ratio in gbv's engine, from its own stats:
  target ms per step = ``time_target / target_calls`` of ``method="ar"``, draft ms per step =
  ``time_draft / draft_steps`` of ``method="block"`` (K = 1, block ``--L``), over the first
  ``--be-prompts`` GSM8K prompts at T = 1, ``--new-tokens`` tokens each; median of 3 interleaved
  rounds (each round pools its prompts);

``--dir`` measures another pair (a dir with ``target/`` and ``draft/``); ``--draft-dir`` replaces
only the draft (e.g. to measure an older draft against the bundled target).

Example::

    python3 scripts/measure_bundled_pair.py --block-efficiency --be-prompts 20 --json scratch/measure.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gbv.engine.cache import cache_keyword  # noqa: E402  (after the path: runs from a checkout)


def load(dir_, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(dir_, dtype=dtype).eval()


def _cache_of(out):
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


@torch.no_grad()
def decode_step_ms(model, prefix: int, repeats: int, warmup: int = 10) -> float:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (1, prefix), generator=g)
    cache = _cache_of(model(input_ids=ids, use_cache=True))
    nxt = torch.tensor([[7]])
    cache_kw = {cache_keyword(model): cache}  # looked up once, outside the timed calls
    times = []
    for i in range(warmup + repeats):
        t = time.perf_counter()
        model(input_ids=nxt, **cache_kw, use_cache=True)
        dt = time.perf_counter() - t
        cache.crop(-1)
        if i >= warmup:
            times.append(dt)
    assert cache.get_seq_length() == prefix
    return 1000 * statistics.median(times)


@torch.no_grad()
def acceptance(target, draft, tok, prompts, temperature: float, new_tokens: int, seed: int):
    tot, n = 0.0, 0
    per_prompt = []
    for i, prompt in enumerate(prompts):
        enc = tok(prompt, return_tensors="pt")
        P = enc.input_ids.shape[1]
        torch.manual_seed(seed + i)
        seq = target.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                              max_new_tokens=new_tokens, min_new_tokens=1)
        m = seq.shape[1] - P
        lp = target(input_ids=seq).logits[0, P - 1:P - 1 + m].float() / temperature
        lq = draft(input_ids=seq).logits[0, P - 1:P - 1 + m].float() / temperature
        ov = torch.minimum(lp.softmax(-1), lq.softmax(-1)).sum(-1)
        tot += ov.sum().item()
        n += m
        per_prompt.append(ov.mean().item())
    return tot / n, n, per_prompt


_PAIR = None


def block_efficiency(prompts, temperature, method, K, L, new_tokens, seed, dirs=None):
    """Total new tokens / total target calls of ``gbv.generate`` over the prompts.

    ``dirs``: ``(target_dir, draft_dir)``, or None for the bundled pair.
    """
    import gbv

    global _PAIR
    if _PAIR is None:
        _PAIR = (gbv.load_pair("bundled", dtype="float32") if dirs is None else
                 gbv.load_pair(str(dirs[0]), str(dirs[1]), dtype="float32"))
    new, calls = 0, 0
    for i, prompt in enumerate(prompts):
        out = gbv.generate(_PAIR, prompt=prompt, method=method, num_paths=K, block_len=L,
                           temperature=temperature, max_new_tokens=new_tokens, seed=seed + i)
        new += out.stats.new_tokens
        calls += out.stats.target_calls
    return new / calls


def engine_step_ms(prompts, L, new_tokens, seed, dirs=None) -> dict:
    """Decode-step times in gbv's engine from its stats (see the module docstring)."""
    import gbv

    global _PAIR
    if _PAIR is None:
        _PAIR = (gbv.load_pair("bundled", dtype="float32") if dirs is None else
                 gbv.load_pair(str(dirs[0]), str(dirs[1]), dtype="float32"))
    for method in ("ar", "block"):  # warm-up (first calls allocate and pick kernels)
        gbv.generate(_PAIR, prompt=prompts[0], method=method, num_paths=1, block_len=L,
                     temperature=1.0, max_new_tokens=8, seed=seed)
    tt, td = [], []
    for _ in range(3):
        t_s = t_n = d_s = d_n = 0
        for i, prompt in enumerate(prompts):
            ar = gbv.generate(_PAIR, prompt=prompt, method="ar", temperature=1.0,
                              max_new_tokens=new_tokens, seed=seed + i).stats
            bl = gbv.generate(_PAIR, prompt=prompt, method="block", num_paths=1, block_len=L,
                              temperature=1.0, max_new_tokens=new_tokens, seed=seed + i).stats
            t_s, t_n = t_s + ar.time_target, t_n + ar.target_calls
            d_s, d_n = d_s + bl.time_draft, d_n + bl.draft_steps
        tt.append(1000 * t_s / t_n)
        td.append(1000 * d_s / d_n)
    t_ms, d_ms = statistics.median(tt), statistics.median(td)
    return {"target": round(t_ms, 2), "draft": round(d_ms, 2), "ratio": round(t_ms / d_ms, 2),
            "target_runs": [round(x, 2) for x in tt], "draft_runs": [round(x, 2) for x in td]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="dir with target/ and draft/ (default: bundled)")
    ap.add_argument("--draft-dir", default=None, help="use this draft instead (target unchanged)")
    ap.add_argument("--datasets", default="gsm8k,humaneval")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="1.0,0.2")
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-acceptance", action="store_true")
    ap.add_argument("--block-efficiency", action="store_true",
                    help="also measure block efficiency of block/gbv via gbv.generate")
    ap.add_argument("--be-prompts", type=int, default=10, help="prompts per data set for it")
    ap.add_argument("--engine-timing", action="store_true",
                    help="also time decode steps in gbv's engine (its stats), see above")
    ap.add_argument("--methods", default="block,gbv",
                    help="methods for --block-efficiency (comma-separated gbv methods)")
    ap.add_argument("--K", type=int, default=3)
    ap.add_argument("--L", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from gbv.data import load_prompts

    torch.set_num_threads(args.threads)
    if args.dir:
        tdir, ddir = Path(args.dir) / "target", Path(args.dir) / "draft"
    else:
        from gbv.models.bundled import bundled_paths

        tdir, ddir = bundled_paths()
    custom = bool(args.dir or args.draft_dir)
    if args.draft_dir:
        ddir = Path(args.draft_dir)
    target, draft = load(tdir), load(ddir)
    tok = AutoTokenizer.from_pretrained(tdir)
    res: dict = {"target_dir": str(tdir), "draft_dir": str(ddir), "args": vars(args)}
    temps = [float(t) for t in args.temperatures.split(",")]
    dsets = args.datasets.split(",")

    if not args.skip_timing:
        # interleave the two models' runs so machine load affects both alike
        tt, td = [], []
        for _ in range(3):
            tt.append(decode_step_ms(target, args.prefix, args.repeats))
            td.append(decode_step_ms(draft, args.prefix, args.repeats))
        t_ms, d_ms = statistics.median(tt), statistics.median(td)
        res["decode_ms"] = {"target": round(t_ms, 2), "draft": round(d_ms, 2),
                            "ratio": round(t_ms / d_ms, 2), "target_runs": [round(x, 2) for x in tt],
                            "draft_runs": [round(x, 2) for x in td]}
        print(f"decode step (batch 1, prefix {args.prefix}, {args.threads} thread(s), median): "
              f"target {t_ms:.2f} ms, draft {d_ms:.2f} ms, ratio {t_ms / d_ms:.2f}", flush=True)

    if args.engine_timing:
        e = engine_step_ms(load_prompts("gsm8k", limit=args.be_prompts), args.L, args.new_tokens,
                           args.seed, (tdir, ddir) if custom else None)
        res["engine_decode_ms"] = e
        print(f"engine decode step (ar target step / block draft step, median of 3 rounds): "
              f"target {e['target']:.2f} ms, draft {e['draft']:.2f} ms, ratio {e['ratio']:.2f}",
              flush=True)

    if not args.skip_acceptance:
        res["acceptance"] = {}
        for ds in dsets:
            prompts = load_prompts(ds, limit=args.prompts)
            for T in temps:
                a, n, per = acceptance(target, draft, tok, prompts, T, args.new_tokens, args.seed)
                res["acceptance"][f"{ds}@T={T}"] = {"rate": round(a, 4), "positions": n,
                                                    "per_prompt_min": round(min(per), 3),
                                                    "per_prompt_max": round(max(per), 3)}
                print(f"acceptance {ds:10s} T={T}: {a:.3f} over {n} positions "
                      f"(per prompt {min(per):.2f}-{max(per):.2f})", flush=True)

    if args.block_efficiency:
        res["block_efficiency"] = {}
        for ds in dsets:
            prompts = load_prompts(ds, limit=args.be_prompts)
            for T in temps:
                for method in args.methods.split(","):
                    from gbv.verify import MULTI_PATH_METHODS

                    k = args.K if method in MULTI_PATH_METHODS else 1
                    be = block_efficiency(prompts, T, method, k, args.L, args.new_tokens,
                                          args.seed, (tdir, ddir) if custom else None)
                    res["block_efficiency"][f"{ds}@T={T}/{method}"] = round(be, 3)
                    print(f"block efficiency {ds:10s} T={T} {method:9s} K={k} L={args.L}: "
                          f"{be:.3f}", flush=True)

    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
