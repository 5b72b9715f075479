"""Random requests through the engine: does any mix crash it, and what differs from a reference?

    python scripts/fuzz_engine.py                                  # batches: 30 trials, float32, seed 0
    python scripts/fuzz_engine.py --trials 30 --dtype bfloat16 --seed 2
    python scripts/fuzz_engine.py --seed 3 --only 29               # rerun one trial
    python scripts/fuzz_engine.py --mode single --trials 150       # single sequences
    python scripts/fuzz_engine.py --family gemma2                  # the bundled pair in Gemma 2's layout
    python scripts/fuzz_engine.py --product-threads 2              # the compiled products split on 2 threads

``--mode batch`` (the default): does a row of a batch commit what it commits alone? Each trial draws
1-6 requests: a method among every verifier, ``ar`` and ``auto``; K 1-4, L 1-8; a temperature of 0,
0.2 or 1 (top-k sometimes); 1-120 new tokens, EOS on or off; a prompt cut from the text of the first
200 bundled GSM8K prompts (fixed, so a trial is the same trial on every revision), of 1 to 1,000
tokens (lengths around the rotary tables' and caches' sizes: 255-257, 511-513, and near the bundled
models' 1,024 positions). They decode as the rows of one
``BatchRows`` of 1..n rows (continuous batching: the rest wait for a free row), chunk events on or off
per row, and sometimes one request is cancelled halfway. Each trial loads a fresh pair, so its tables
and caches start as a new process's. Every row that ran to its end, but the ``auto`` ones (their arms
depend on the batch), is then compared with ``generate`` on its prompt alone.

A crash is a bug. So is a differing row where the compiled CPU kernels run (one thread): their sums
run in one order for every pass, so a token's logits do not depend on the rows, row counts or slot
layout of the pass it is in, and a row commits what it commits alone, bit for bit (docs/ENGINE.md, "One
sum order for every pass"); the run then exits 1. Elsewhere (a GPU, torch's products) the batch
computes a row's logits to rounding of the lone ones only, and a differing row is reported, not
failed. The summary counts both, greedy and sampled rows apart.

``--mode single``: each trial is one ``generate`` call with random settings (every method, K 1-6, L
1-12, temperatures 0-1.5, top-k, top-p, a draft temperature, stop strings, EOS on or off) on a prompt
of 1 to 1,023 tokens. A crash or a GbvError is reported; a greedy speculative generation is compared
with greedy ``ar`` on the same prompt. On the compiled CPU kernels they are the same tokens (a tree
pass computes each token's logits as a one-token step does), and a difference fails the run. Elsewhere
they agree but for rounding, and a near-tie can go the other way; where they differ, the two tokens'
logits in the float32 Hugging Face forward at that point are printed: a near-tie is rounding, a clear
gap would be a bug.

``--family``: the bundled pair rewritten in another family's layout (``tests/engine/engine_toy.py``,
``as_family``: phi3, granite, gemma, gemma2, gemma3, mistral, smollm3; the windowed ones slide over 128
positions, so long prompts pass their windows); gptneox, gpt2, opt, gpt-bigcode, starcoder2, phi, olmo,
olmo2, olmo3, gptj: random models of the bundled shapes (``shaped_like``: their layers cannot compute the
bundled function). Only Phi-3 runs on the compiled kernels like the bundled pair; the others run on the
torch forward, where differences are reported, not failed.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "engine"))

import gbv  # noqa: E402
from gbv.data import load_prompts  # noqa: E402
from gbv.engine.batch import BatchTreeDecoder  # noqa: E402
from gbv.engine.generate import BatchRows, generate, prepare_job  # noqa: E402
from gbv.engine.host_kernels import host_kernels_unavailable  # noqa: E402
from gbv.errors import GbvError  # noqa: E402
from gbv.verify import METHODS  # noqa: E402

from engine_toy import SHAPED_LIKE, family_models  # noqa: E402

PROMPT_LENGTHS = (1, 3, 64, 255, 256, 257, 511, 512, 513, 900, 1000)


def draw_trial(rnd: random.Random, text_ids: list[int]) -> tuple[list[tuple[list[int], dict]], int]:
    """The requests of one trial, ``(prompt ids, settings)`` each, and the batch's rows."""
    methods = [*METHODS, "ar", "auto"]
    requests = []
    for _ in range(rnd.randint(1, 6)):
        start = rnd.randint(0, len(text_ids) - max(PROMPT_LENGTHS))
        length = rnd.choice(PROMPT_LENGTHS)
        settings = dict(method=rnd.choice(methods), num_paths=rnd.randint(1, 4), block_len=rnd.randint(1, 8),
                        temperature=rnd.choice([0.0, 0.2, 1.0]), max_new_tokens=rnd.randint(1, 120),
                        eos_token_id=[] if rnd.random() < 0.5 else None, seed=rnd.randint(0, 100))
        if rnd.random() < 0.2:
            settings["top_k"] = rnd.choice([1, 5, 50])
        requests.append((text_ids[start:start + length], settings))
    return requests, rnd.randint(1, len(requests))


def run_batch(pair, requests, max_rows: int, rnd: random.Random) -> tuple[dict[int, list[int]], int | None]:
    """Every request through one BatchRows; returns ``index -> token ids`` of the rows that ran to their
    end, and the index of the cancelled one (or None)."""
    jobs = [prepare_job(pair, ids, **settings) for ids, settings in requests]
    rows = BatchRows(pair, BatchTreeDecoder(pair.target, pair.draft, jobs[0].vocab, pair.device, max_rows))
    waiting = list(enumerate(jobs))
    cancel = rnd.randrange(len(jobs)) if len(jobs) > 1 and rnd.random() < 0.2 else None
    cancel_at = rnd.randint(1, 20)
    done: dict[int, list[int]] = {}
    steps = 0

    def collect(events) -> None:
        for key, event, value in events:
            if event == "error":
                raise value
            if event == "done":
                done[key] = value.token_ids

    while waiting or rows.active:
        while waiting and rows.has_room():
            key, job = waiting.pop(0)
            collect(rows.add(key, job, emit=rnd.random() < 0.5))
        collect(rows.step())
        steps += 1
        if cancel is not None and steps == cancel_at:
            if cancel in rows.active:
                rows.cancel(cancel)
            else:
                waiting = [(key, job) for key, job in waiting if key != cancel]
    if cancel is not None:  # (not compared, whether it was cancelled or had finished before)
        done.pop(cancel, None)
    return done, cancel


def exact_rows(args) -> bool:
    """Whether rows must equal their references bit for bit: on the CPU where the compiled kernels run
    (``main`` sets one thread), for a family they run (the bundled Llama pair, Phi-3, and since the
    thirty-ninth session GPT-NeoX, GPT-2, OPT, GPT-BigCode, Phi and GPT-J; since the forty-first Qwen3 and
    Granite)."""
    return (args.device == "cpu" and host_kernels_unavailable() is None and torch.get_num_threads() == 1
            and args.family in ("llama", "phi3", "gptneox", "gpt2", "opt", "gpt-bigcode", "phi", "gptj", "qwen3",
                                "granite"))


def load(args):
    """A fresh pair: the bundled one, or it rewritten in ``args.family``'s layout."""
    if args.family == "llama":
        return gbv.load_pair("bundled", device=args.device, dtype=args.dtype)
    from gbv.models.loading import ModelPair

    bundled = gbv.load_pair("bundled", dtype="float32")
    target, draft = family_models(bundled.target, bundled.draft, args.family)
    target, draft = (model.to(device=args.device, dtype=getattr(torch, args.dtype)) for model in (target, draft))
    return ModelPair(target, draft, tokenizer=bundled.tokenizer)


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter's length where one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def single_trial(pair, rnd: random.Random, text_ids: list[int]) -> tuple[dict, list[int], str | None]:
    """One generate call with random settings; returns (settings, prompt, what differs or None)."""
    length = rnd.choice((1, 2, 17, 255, 256, 257, 600, 1000, 1020, 1023))
    start = rnd.randint(0, len(text_ids) - 1100)
    ids = text_ids[start:start + length]
    settings = dict(method=rnd.choice([*METHODS, "ar", "auto"]), num_paths=rnd.randint(1, 6),
                    block_len=rnd.randint(1, 12), temperature=rnd.choice([0.0, 0.0, 0.2, 0.7, 1.0, 1.5]),
                    max_new_tokens=rnd.randint(1, 150), seed=rnd.randint(0, 9))
    if rnd.random() < 0.3:
        settings["top_k"] = rnd.choice([1, 2, 10, 100])
    if rnd.random() < 0.3:
        settings["top_p"] = rnd.choice([0.1, 0.5, 0.9, 1.0])
    if rnd.random() < 0.3:
        settings["draft_temperature"] = rnd.choice([0.0, 0.1, 0.5, 1.0, 2.0])
    if rnd.random() < 0.3:
        settings["eos_token_id"] = []
    if rnd.random() < 0.2:
        settings["stop_strings"] = [rnd.choice(["\n", ".", "the", "```"])]
    out = generate(pair, prompt_ids=ids, **settings)
    if settings["temperature"] != 0 or settings["method"] == "ar":
        return settings, ids, None
    ref = generate(pair, prompt_ids=ids, **{**settings, "method": "ar"}).token_ids
    if ref == out.token_ids:
        return settings, ids, ""
    first = first_difference(ref, out.token_ids)
    gap = ""
    if first < min(len(ref), len(out.token_ids)):
        gap = f"; {near_tie(pair, ids + ref[:first], ref[first], out.token_ids[first])}"
    return settings, ids, f"greedy {settings['method']} differs from greedy ar from token {first} of {len(ref)}{gap}"


@torch.inference_mode()
def near_tie(pair, context: list[int], token_a: int, token_b: int) -> str:
    """How far apart the two tokens' logits are after ``context`` in the float32 Hugging Face forward of
    the pair's target: a near-tie (a few thousandths) is rounding; a clear gap would be a bug."""
    target = pair.target if pair.target.dtype == torch.float32 else copy.deepcopy(pair.target).float()
    logits = target(torch.tensor([context], device=target.device)).logits[0, -1].cpu()
    order = torch.argsort(logits, descending=True).tolist()
    return (f"float32 logits {float(logits[token_a]):.4f} and {float(logits[token_b]):.4f} "
            f"(ranks {order.index(token_a) + 1} and {order.index(token_b) + 1})")


def main_single(args, trials, text_ids: list[int]) -> int:
    pair = load(args)
    crashes = errors = greedy = differ = 0
    started = time.perf_counter()
    for trial in trials:
        rnd = random.Random(args.seed * 1000 + trial)
        try:
            settings, ids, outcome = single_trial(pair, rnd, text_ids)
        except GbvError as exc:
            errors += 1
            print(f"trial {trial}: GbvError: {exc}", flush=True)
            continue
        except Exception:  # noqa: BLE001 - reported, and the next trial runs
            crashes += 1
            traceback.print_exc()
            print(f"trial {trial}: CRASH", flush=True)
            continue
        if outcome is not None:
            greedy += 1
            differ += bool(outcome)
        if outcome:
            print(f"trial {trial} ({len(ids)}-token prompt, {settings}): {outcome}", flush=True)
    print(f"\nsingle sequences, {args.family}, {args.device}, {args.dtype}, seed {args.seed}, {time.perf_counter() - started:.0f} s: "
          f"{len(trials)} trials, {crashes} crashed, {errors} GbvErrors; greedy speculative runs: {greedy}, "
          f"of which {differ} differ from greedy ar")
    return 1 if crashes or (differ and exact_rows(args)) else 0


def main_batch(args, trials, text_ids: list[int]) -> int:
    totals = dict(trials=0, crashes=0, rows=0, greedy=0, greedy_differ=0, sampled=0, sampled_differ=0)
    started = time.perf_counter()
    for trial in trials:
        rnd = random.Random(args.seed * 1000 + trial)
        requests, max_rows = draw_trial(rnd, text_ids)
        totals["trials"] += 1
        # A fresh pair a trial: its lean views start with the tables and caches of a new process (a
        # served request past the draft's first rotary table crashed only there).
        pair = load(args)
        try:
            done, cancelled = run_batch(pair, requests, max_rows, rnd)
        except Exception:  # noqa: BLE001 - reported, and the next trial runs
            totals["crashes"] += 1
            traceback.print_exc()
            print(f"trial {trial}: CRASH with {max_rows} rows: {[(len(ids), s) for ids, s in requests]}", flush=True)
            continue
        differ = []
        for index, tokens in done.items():
            ids, settings = requests[index]
            if settings["method"] == "auto":
                continue
            kind = "greedy" if settings["temperature"] == 0 or settings.get("top_k") == 1 else "sampled"
            totals["rows"] += 1
            totals[kind] += 1
            alone = generate(pair, prompt_ids=ids, **settings).token_ids
            if alone != tokens:
                totals[kind + "_differ"] += 1
                differ.append(f"row {index} ({len(ids)}-token prompt, {settings}) from token "
                              f"{first_difference(alone, tokens)} of {len(alone)}")
        note = f"; cancelled row {cancelled}" if cancelled is not None else ""
        print(f"trial {trial}: {len(requests)} requests, {max_rows} rows{note}: "
              + ("; ".join(differ) if differ else "every compared row as alone"), flush=True)
    print(f"\n{args.family}, {args.device}, {args.dtype}, seed {args.seed}, {time.perf_counter() - started:.0f} s: {totals['trials']} trials, "
          f"{totals['crashes']} crashed; rows compared with alone: {totals['rows']} "
          f"(greedy {totals['greedy']}, of which {totals['greedy_differ']} differ; "
          f"sampled {totals['sampled']}, of which {totals['sampled_differ']} differ)")
    differ = totals["greedy_differ"] + totals["sampled_differ"]
    return 1 if totals["crashes"] or (differ and exact_rows(args)) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0, help="trial t draws from random.Random(seed * 1000 + t)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--only", default=None, help="comma-separated trial numbers to run (default: all)")
    parser.add_argument("--mode", choices=("batch", "single"), default="batch")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda (scripts/gpu_check.sh, part fuzz)")
    parser.add_argument("--family", default="llama", choices=("llama", "phi3", "granite", "gemma", "gemma2", "gemma3",
                                                              "mistral", "smollm3", *SHAPED_LIKE),
                        help="the bundled pair as is (llama) or rewritten in this family's layout (gptneox, gpt2, "
                             "opt, gpt-bigcode, starcoder2, phi, olmo, olmo2, olmo3, gptj, qwen3: random models of its "
                             "shapes)")
    parser.add_argument("--product-threads", type=int, default=1,
                        help="the compiled products' threads (torch keeps one; the same bits at any count)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from gbv.engine.host_kernels import set_product_threads

    set_product_threads(args.product_threads)
    text = "\n\n".join(load_prompts("gsm8k", 200))
    text_ids = gbv.load_pair("bundled").tokenizer.encode(text)
    trials = [int(t) for t in args.only.split(",")] if args.only else range(args.trials)
    return (main_single if args.mode == "single" else main_batch)(args, trials, text_ids)


if __name__ == "__main__":
    sys.exit(main())
