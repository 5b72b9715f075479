#!/usr/bin/env python3
"""Train the small bundled target/draft Llama pair shipped in ``gbv/models/bundled/``.

Run once by hand (not part of CI). Uses only local data:

* GSM8K train split (``/work/shared/data/gsm8k/train.jsonl`` by default), each record formatted
  as ``"Question: <question>\\nAnswer: <answer>"`` like the prompts of ``gbv.data``;
* Python source of the standard library of the running interpreter (``*.py``, excluding
  ``site-packages`` and test directories), capped at ``--max-python-mb``.

Steps: (a) byte-level BPE tokenizer (HF ``tokenizers``) with ``<|endoftext|>`` as bos/eos/pad;
(b) a draft and a target ``LlamaForCausalLM`` trained on packed sequences of the corpus
(documents separated by eos), each for a wall-clock budget with a linear-warmup + cosine LR
schedule sized to that budget. Loss curves go to ``<out>/<model>/loss_curve.csv``.

Example (what produced the bundled target, and the first, non-distilled draft)::

    nohup python3 scripts/train_bundled_pair.py --out scratch/pair \\
        --batch-size 8 --draft-minutes 10 --target-minutes 47 --eval-every-s 90 \\
        --heldout-batches 2 > scratch/train.log 2>&1 &
    python3 scripts/train_bundled_pair.py --package scratch/pair gbv/models/bundled

Distillation stage (``--distill-from TARGET_DIR``): the target stays fixed and a new draft is
trained on the target's next-token distributions over the same training corpus (same split, the
target's own tokenizer), with loss ``(1 - a) * KL(p_target || q_draft) + a * CE(q_draft, data)``
(``a = --distill-ce``). One target forward per batch (no backward). ``--distill-init target``
copies the target's embeddings (= tied LM head), final norm and first ``layers`` decoder layers
into the draft, which needs the draft to have the target's width. Every ``--eval-every-s`` it logs
the held-out token-level acceptance ``E[sum_v min(p_T(v), q_T(v))]`` at T = 1 and T = 0.2 (over
held-out corpus positions, target logits computed once). It checkpoints (model, optimiser, RNG,
clock) every ``--save-every-s`` to ``<out>/distill_ckpt.pt`` and resumes from it when rerun with
the same ``--out``: the wall-clock budget counts the time of all runs together. What shipped::

    OMP_NUM_THREADS=1 nohup python3 scripts/train_bundled_pair.py --out scratch/distil \\
        --distill-from gbv/models/bundled/target --draft 256,1,8,768 --distill-init target \\
        --distill-minutes 48 --distill-ce 0 --threads 1 --batch-size 4 --seq-len 256 \\
        --eval-every-s 120 --save-every-s 180 --heldout-batches 4 > scratch/distil.log 2>&1 &
    python3 scripts/train_bundled_pair.py --package scratch/distil gbv/models/bundled \\
        --package-models draft
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

EOS = "<|endoftext|>"


# --------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------
def gsm8k_docs(path: Path) -> list[str]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                docs.append(f"Question: {rec['question'].strip()}\nAnswer: {rec['answer'].strip()}")
    return docs


SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings",
             "pydoc_data", "turtledemo", "lib-dynload", "dist-packages"}


def python_docs(root: Path, max_bytes: int) -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_DIRS and not d.startswith("config-"))
        for fn in sorted(filenames):
            if fn.endswith(".py") and not fn.startswith("test_") and not fn.startswith("_sysconfigdata"):
                files.append(Path(dirpath) / fn)
    files.sort()
    docs, total = [], 0
    rng = random.Random(1234)
    rng.shuffle(files)
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip() or len(text) > 400_000:
            continue
        if total + len(text) > max_bytes:
            continue
        docs.append(text)
        total += len(text)
    return docs


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------
def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    eos_id = tok.token_to_id(EOS)
    # prepend bos (= eos) like the training documents, which all start after an eos separator
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B", special_tokens=[(EOS, eos_id)])
    return tok


def hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=None,
        model_max_length=1024, clean_up_tokenization_spaces=False)


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------
def make_model(hidden: int, layers: int, heads: int, inter: int, vocab: int, eos_id: int,
               max_pos: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_pos, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        initializer_range=0.02, attention_bias=False, mlp_bias=False,
    )
    model = LlamaForCausalLM(cfg)
    return model


@torch.no_grad()
def set_lr(opt, lr: float, step: int, frac: float, args) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_frac`` over the time budget; sets and returns it."""
    warm = min(1.0, (step + 1) / args.warmup_steps)
    cos = args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac))
    for g in opt.param_groups:
        g["lr"] = lr * warm * cos
    return lr * warm * cos


def optimizer_step(opt, loss: torch.Tensor, model) -> float:
    """Backward, clip the gradient norm to 1, step; returns the loss value."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def sample_batch(rng, train_ids, batch: int, length: int) -> torch.Tensor:
    """``batch`` random windows of ``length + 1`` training tokens, (batch, length + 1) long."""
    starts = rng.integers(0, len(train_ids) - length - 1, size=batch)
    return torch.from_numpy(np.stack([train_ids[s:s + length + 1] for s in starts]).astype(np.int64))


def heldout_loss(model, batches) -> float:
    model.eval()
    tot, n = 0.0, 0
    for x in batches:
        logits = model(input_ids=x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        n += x[:, 1:].numel()
    model.train()
    return tot / n


def train_model(name, model, train_ids: np.ndarray, val_batches, args, minutes: float, lr: float,
                out_dir: Path, save_fn):
    rng = np.random.default_rng(args.seed + (1 if name == "target" else 0))
    budget = minutes * 60.0
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            eps=1e-8)
    T, B = args.seq_len, args.batch_size
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{name}] params={n_params:,} budget={minutes:.1f} min lr={lr}", flush=True)
    curve_path = out_dir / name / "loss_curve.csv"
    curve_path.parent.mkdir(parents=True, exist_ok=True)
    fcsv = open(curve_path, "w", newline="")
    w = csv.writer(fcsv)
    w.writerow(["step", "tokens_seen", "elapsed_s", "lr", "train_loss", "heldout_loss"])
    model.train()
    t0 = time.time()
    step, tokens, ema = 0, 0, None
    last_eval = t0
    last_save = t0
    vl = heldout_loss(model, val_batches)
    w.writerow([0, 0, 0.0, 0.0, "", f"{vl:.4f}"])
    fcsv.flush()
    t0 = time.time()
    while True:
        elapsed = time.time() - t0
        frac = elapsed / budget
        if frac >= 1.0:
            break
        cur_lr = set_lr(opt, lr, step, frac, args)
        x = sample_batch(rng, train_ids, B, T)
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        li = optimizer_step(opt, loss, model)
        step += 1
        tokens += B * T
        ema = li if ema is None else 0.9 * ema + 0.1 * li
        now = time.time()
        if now - last_eval >= args.eval_every_s:
            vl = heldout_loss(model, val_batches)
            last_eval = time.time()
            w.writerow([step, tokens, f"{now - t0:.1f}", f"{cur_lr:.2e}", f"{ema:.4f}", f"{vl:.4f}"])
            fcsv.flush()
            print(f"[{name}] step {step} tok {tokens:,} t {now - t0:.0f}s lr {cur_lr:.2e} "
                  f"train {ema:.4f} held-out {vl:.4f} ({tokens / (now - t0):.0f} tok/s)",
                  flush=True)
        if now - last_save >= args.save_every_s:
            save_fn(model)
            last_save = time.time()
    elapsed = time.time() - t0
    vl = heldout_loss(model, val_batches)
    w.writerow([step, tokens, f"{elapsed:.1f}", "0", f"{ema:.4f}", f"{vl:.4f}"])
    fcsv.close()
    print(f"[{name}] done: {step} steps, {tokens:,} tokens, {elapsed:.0f}s, "
          f"train(ema) {ema:.4f} held-out {vl:.4f}", flush=True)
    return {"steps": step, "tokens_seen": tokens, "train_seconds": round(elapsed, 1),
            "final_train_loss_ema": round(ema, 4), "final_heldout_loss_fp32": round(vl, 4),
            "params": n_params}



# --------------------------------------------------------------------------------------------
# distillation of a draft from a fixed target
# --------------------------------------------------------------------------------------------
ACCEPT_TEMPERATURES = (1.0, 0.2)


def distill_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor,
                 ce_weight: float) -> tuple[torch.Tensor, float, float]:
    """``(1 - ce_weight) * KL(p || q) + ce_weight * CE(q, labels)``, means over positions.

    ``draft_logits``, ``target_logits``: ``(B, T, V)``; ``labels``: ``(B, T)`` next tokens.
    Returns ``(loss, kl, ce)`` with ``kl`` and ``ce`` as floats for logging.
    """
    V = draft_logits.size(-1)
    logq = torch.log_softmax(draft_logits.float().reshape(-1, V), -1)
    logp = torch.log_softmax(target_logits.float().reshape(-1, V), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    ce = torch.nn.functional.nll_loss(logq, labels.reshape(-1))
    loss = (1.0 - ce_weight) * kl + ce_weight * ce if ce_weight > 0 else kl
    return loss, kl.item(), ce.item()


@torch.no_grad()
def heldout_distill_metrics(draft, batches, target_logits) -> dict[str, float]:
    """Held-out CE, KL(p || q) and token-level acceptance ``E[sum_v min(p_T, q_T)]``.

    ``batches``: list of ``(b, T + 1)`` token tensors; ``target_logits``: the target's logits on
    each batch's first T tokens, ``(b, T, V)``, computed once. Acceptance is the overlap of the two
    temperature-T softmax distributions at every held-out position (what speculative sampling
    accepts per token), for each T in ``ACCEPT_TEMPERATURES``.
    """
    draft.eval()
    tot = {"ce": 0.0, "kl": 0.0, **{f"accept_T{t}": 0.0 for t in ACCEPT_TEMPERATURES}}
    n = 0
    for x, lp in zip(batches, target_logits):
        lq = draft(input_ids=x[:, :-1]).logits.float()
        V = lq.size(-1)
        lq2, lp2 = lq.reshape(-1, V), lp.reshape(-1, V)
        tot["ce"] += torch.nn.functional.cross_entropy(lq2, x[:, 1:].reshape(-1),
                                                       reduction="sum").item()
        logp, logq = lp2.log_softmax(-1), lq2.log_softmax(-1)
        tot["kl"] += (logp.exp() * (logp - logq)).sum().item()
        for t in ACCEPT_TEMPERATURES:
            tot[f"accept_T{t}"] += torch.minimum((lp2 / t).softmax(-1),
                                                 (lq2 / t).softmax(-1)).sum().item()
        n += lq2.size(0)
    draft.train()
    return {k: v / n for k, v in tot.items()}


def init_draft_from_target(draft, target) -> None:
    """Copy embeddings (tied LM head), final norm and the first decoder layers of the target.

    The draft must have the target's hidden size; it keeps its own number of layers.
    """
    if draft.config.hidden_size != target.config.hidden_size:
        raise SystemExit("--distill-init target needs the draft's hidden size to equal the "
                         f"target's ({target.config.hidden_size}); change --draft")
    tsd = target.state_dict()
    own = draft.state_dict()
    copied = {k: tsd[k] for k in own if k in tsd and tsd[k].shape == own[k].shape}
    draft.load_state_dict(copied, strict=False)
    print(f"[distill] copied {len(copied)}/{len(own)} tensors from the target", flush=True)


def distill_draft(args, train_ids: np.ndarray, held_ids: np.ndarray, out: Path, eos_id: int,
                  save_dir_fn) -> dict:
    """Train a new draft on the fixed target's next-token distributions (resumable)."""
    from transformers import AutoModelForCausalLM

    tdir = Path(args.distill_from)
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    for prm in target.parameters():
        prm.requires_grad_(False)
    h, l, nh, inter = (int(v) for v in args.draft.split(","))
    torch.manual_seed(args.seed)
    draft = make_model(h, l, nh, inter, target.config.vocab_size, eos_id, args.max_pos)
    if args.distill_init == "target":
        init_draft_from_target(draft, target)
    elif args.distill_init != "random":
        draft.load_state_dict(AutoModelForCausalLM.from_pretrained(
            args.distill_init, dtype=torch.float32).state_dict())
        print(f"[distill] warm start from {args.distill_init}", flush=True)
    n_params = sum(prm.numel() for prm in draft.parameters())

    T, B = args.seq_len, args.batch_size
    nval = min(args.heldout_batches * 4, (len(held_ids) - 1) // (T + 1))
    val = torch.from_numpy(held_ids[:nval * (T + 1)].reshape(nval, T + 1).astype(np.int64))
    val_batches = list(torch.split(val, 4))
    with torch.no_grad():
        val_tlogits = [target(input_ids=x[:, :-1]).logits.float() for x in val_batches]
    print(f"[distill] held-out: {nval} x {T} positions; target held-out CE "
          f"{heldout_loss(target, val_batches):.4f}", flush=True)

    budget = args.distill_minutes * 60.0
    lr = args.distill_lr
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            eps=1e-8)
    rng = np.random.default_rng(args.seed + 2)
    ckpt_path = out / "distill_ckpt.pt"
    curve_path = out / "draft" / "loss_curve.csv"
    curve_path.parent.mkdir(parents=True, exist_ok=True)
    header = ["step", "tokens_seen", "elapsed_s", "lr", "train_loss", "train_kl", "train_ce",
              "heldout_loss", "heldout_kl", *[f"heldout_accept_T{t}" for t in ACCEPT_TEMPERATURES]]
    step, tokens, elapsed0, ema = 0, 0, 0.0, None
    ema_kl = ema_ce = None
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        draft.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        rng.bit_generator.state = ck["rng"]
        torch.set_rng_state(ck["torch_rng"])
        step, tokens, elapsed0 = ck["step"], ck["tokens"], ck["elapsed"]
        ema, ema_kl, ema_ce = ck["ema"], ck["ema_kl"], ck["ema_ce"]
        # drop curve rows written after the checkpoint (they belong to the lost tail)
        rows = list(csv.reader(open(curve_path))) if curve_path.exists() else [header]
        rows = [rows[0]] + [r for r in rows[1:] if int(r[0]) <= step]
        with open(curve_path, "w", newline="") as f:
            csv.writer(f).writerows(rows)
        print(f"[distill] resumed from {ckpt_path}: step {step}, {elapsed0:.0f}s used", flush=True)
    fcsv = open(curve_path, "a" if step else "w", newline="")
    w = csv.writer(fcsv)

    def log_eval(elapsed, cur_lr):
        m = heldout_distill_metrics(draft, val_batches, val_tlogits)
        w.writerow([step, tokens, f"{elapsed:.1f}", f"{cur_lr:.2e}",
                    "" if ema is None else f"{ema:.4f}", "" if ema_kl is None else f"{ema_kl:.4f}",
                    "" if ema_ce is None else f"{ema_ce:.4f}", f"{m['ce']:.4f}", f"{m['kl']:.4f}",
                    *[f"{m[f'accept_T{t}']:.4f}" for t in ACCEPT_TEMPERATURES]])
        fcsv.flush()
        acc = " ".join(f"T={t}: {m[f'accept_T{t}']:.4f}" for t in ACCEPT_TEMPERATURES)
        print(f"[distill] step {step} tok {tokens:,} t {elapsed:.0f}s lr {cur_lr:.2e} train "
              f"{'-' if ema is None else f'{ema:.4f}'} held-out CE {m['ce']:.4f} KL {m['kl']:.4f}"
              f" accept {acc}", flush=True)
        return m

    def checkpoint(elapsed):
        save_dir_fn(draft)
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": draft.state_dict(), "opt": opt.state_dict(),
                    "rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
                    "step": step, "tokens": tokens, "elapsed": elapsed, "ema": ema,
                    "ema_kl": ema_kl, "ema_ce": ema_ce}, tmp)
        os.replace(tmp, ckpt_path)

    print(f"[distill] draft {args.draft} params={n_params:,} budget={args.distill_minutes:.1f} "
          f"min lr={lr} ce weight={args.distill_ce} init={args.distill_init}", flush=True)
    if step == 0:
        w.writerow(header)
        log_eval(0.0, 0.0)
    draft.train()
    t0 = time.time() - elapsed0
    last_eval = last_save = time.time()
    cur_lr = 0.0
    while True:
        elapsed = time.time() - t0
        frac = elapsed / budget
        if frac >= 1.0:
            break
        cur_lr = set_lr(opt, lr, step, frac, args)
        x = sample_batch(rng, train_ids, B, T)
        with torch.no_grad():
            tlogits = target(input_ids=x[:, :-1]).logits
        dlogits = draft(input_ids=x[:, :-1]).logits
        loss, kl, ce = distill_loss(dlogits, tlogits, x[:, 1:], args.distill_ce)
        li = optimizer_step(opt, loss, draft)
        step += 1
        tokens += B * T
        ema = li if ema is None else 0.9 * ema + 0.1 * li
        ema_kl = kl if ema_kl is None else 0.9 * ema_kl + 0.1 * kl
        ema_ce = ce if ema_ce is None else 0.9 * ema_ce + 0.1 * ce
        now = time.time()
        if now - last_eval >= args.eval_every_s:
            log_eval(now - t0, cur_lr)
            last_eval = time.time()
        if now - last_save >= args.save_every_s:
            checkpoint(time.time() - t0)
            last_save = time.time()
    elapsed = time.time() - t0
    m = log_eval(elapsed, 0.0)
    fcsv.close()
    checkpoint(elapsed)
    res = {"steps": step, "tokens_seen": tokens, "train_seconds": round(elapsed, 1),
           "final_train_loss_ema": round(ema, 4), "final_train_kl_ema": round(ema_kl, 4),
           "final_train_ce_ema": round(ema_ce, 4),
           "final_heldout_loss_fp32": round(m["ce"], 4), "final_heldout_kl_fp32": round(m["kl"], 4),
           **{f"final_heldout_accept_T{t}": round(m[f"accept_T{t}"], 4)
              for t in ACCEPT_TEMPERATURES},
           "heldout_positions": nval * T, "params": n_params,
           "arch": {"hidden": h, "layers": l, "heads": nh, "intermediate": inter},
           "distilled_from": str(tdir), "ce_weight": args.distill_ce, "init": args.distill_init,
           "lr": lr}
    # quantisation check: held-out metrics after rounding the weights to fp16
    m2 = make_model(h, l, nh, inter, target.config.vocab_size, eos_id, args.max_pos)
    m2.load_state_dict({k: v.half().float() for k, v in draft.state_dict().items()})
    mq = heldout_distill_metrics(m2, val_batches, val_tlogits)
    res["heldout_loss_float16_weights"] = round(mq["ce"], 4)
    res["heldout_accept_T1.0_float16_weights"] = round(mq["accept_T1.0"], 4)
    print(f"[distill] done: {res}", flush=True)
    return res


def package(src: Path, dest: Path, dtype: str = "float16",
            models: tuple[str, ...] = ("target", "draft")) -> None:
    """Copy a trained pair from ``src`` to ``dest`` (e.g. ``gbv/models/bundled``).

    Weights are stored in ``dtype`` to halve the size, but ``config.json`` keeps
    ``"dtype": "float32"`` so that ``from_pretrained`` (default ``dtype="auto"``) upcasts them on
    load: half-precision matmuls are slow on CPU. ``models`` selects which of the two to copy
    (``("draft",)`` after a distillation run leaves the packaged target untouched).
    """
    import shutil

    from transformers import AutoModelForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    for name in models:
        model = AutoModelForCausalLM.from_pretrained(src / name, dtype=torch.float32)
        d = dest / name
        if d.exists():
            shutil.rmtree(d)
        model.to(getattr(torch, dtype)).save_pretrained(d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["dtype"] = "float32"
        (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(src / name / f, d / f)
        (d / "model.safetensors").chmod(0o644)  # safetensors writes 0600
        shutil.copy(src / name / "loss_curve.csv", dest / f"loss_curve_{name}.csv")
    shutil.copy(src / "train_summary.json", dest / "train_summary.json")
    total = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"packaged {src} -> {dest} ({total / 2**20:.1f} MiB)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--package", nargs=2, metavar=("SRC", "DEST"), default=None,
                    help="only copy a trained pair SRC (dir with target/, draft/) to DEST in fp16")
    ap.add_argument("--out", default="scratch/pair")
    ap.add_argument("--gsm8k", default="/work/shared/data/gsm8k/train.jsonl")
    ap.add_argument("--python-lib", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--max-python-mb", type=float, default=12.0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--draft", default="128,1,4,384", help="hidden,layers,heads,intermediate")
    ap.add_argument("--target", default="256,8,8,768", help="hidden,layers,heads,intermediate")
    ap.add_argument("--draft-minutes", type=float, default=13.0)
    ap.add_argument("--target-minutes", type=float, default=42.0)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--target-lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--eval-every-s", type=float, default=60.0)
    ap.add_argument("--save-every-s", type=float, default=600.0)
    ap.add_argument("--heldout-frac", type=float, default=0.02)
    ap.add_argument("--heldout-batches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["both", "draft", "target"], default="both")
    ap.add_argument("--init-from", default=None,
                    help="warm-start each model from DIR/<draft|target> (continued training)")
    ap.add_argument("--package-models", default="target,draft",
                    help="with --package: which models to copy (draft: after distillation)")
    ap.add_argument("--distill-from", default=None, metavar="TARGET_DIR",
                    help="distillation stage: train only a draft on this fixed target's "
                         "next-token distributions (its tokenizer is reused, not retrained)")
    ap.add_argument("--distill-minutes", type=float, default=50.0)
    ap.add_argument("--distill-lr", type=float, default=2e-3)
    ap.add_argument("--distill-ce", type=float, default=0.0,
                    help="weight a of the data cross-entropy: loss = (1-a) KL(p||q) + a CE")
    ap.add_argument("--distill-init", default="target",
                    help="'target' (copy embeddings, norm, first layers), 'random', or a "
                         "draft dir to warm-start from")
    args = ap.parse_args(argv)
    if args.package:
        package(Path(args.package[0]), Path(args.package[1]),
                models=tuple(args.package_models.split(",")))
        return 0

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    gdocs = gsm8k_docs(Path(args.gsm8k))
    pdocs = python_docs(Path(args.python_lib), int(args.max_python_mb * 1e6))
    docs = gdocs + pdocs
    random.Random(args.seed).shuffle(docs)
    n_held = max(1, int(len(docs) * args.heldout_frac))
    held_docs, train_docs = docs[:n_held], docs[n_held:]
    print(f"corpus: {len(gdocs)} gsm8k docs ({sum(map(len, gdocs)) / 1e6:.1f} MB), "
          f"{len(pdocs)} python files ({sum(map(len, pdocs)) / 1e6:.1f} MB); "
          f"held-out {n_held} docs", flush=True)

    if args.distill_from:
        from tokenizers import Tokenizer

        # the target's own tokenizer: the draft must share it byte for byte
        tok = Tokenizer.from_file(str(Path(args.distill_from) / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_docs, args.vocab)
    eos_id = tok.token_to_id(EOS)
    vocab = tok.get_vocab_size()
    hf_tok = hf_tokenizer(tok)
    print(f"tokenizer: vocab {vocab}, eos id {eos_id} ({time.time() - t_start:.0f}s)", flush=True)

    def encode_stream(ds):
        encs = tok.encode_batch(ds, add_special_tokens=False)
        parts = []
        for e in encs:
            parts.append(np.array([eos_id], dtype=np.int32))
            parts.append(np.array(e.ids, dtype=np.int32))
        parts.append(np.array([eos_id], dtype=np.int32))
        return np.concatenate(parts)

    train_ids = encode_stream(train_docs)
    held_ids = encode_stream(held_docs)
    nbytes = sum(len(d.encode()) for d in train_docs)
    print(f"tokens: train {len(train_ids):,} ({nbytes / len(train_ids):.2f} bytes/token), "
          f"held-out {len(held_ids):,} ({time.time() - t_start:.0f}s)", flush=True)
    if args.distill_from:
        return distill_main(args, out, train_ids, held_ids, eos_id, nbytes, t_start)
    T = args.seq_len
    nval = min(args.heldout_batches * 8, (len(held_ids) - 1) // (T + 1))
    val = torch.from_numpy(held_ids[:nval * (T + 1)].reshape(nval, T + 1).astype(np.int64))
    val_batches = list(torch.split(val, 8))

    from transformers import GenerationConfig

    def saver(name):
        def save(model):
            d = out / name
            model.save_pretrained(d)
            hf_tok.save_pretrained(d)
            GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=128).save_pretrained(d)
        return save

    summary = {"args": vars(args), "vocab": vocab, "train_tokens": int(len(train_ids)),
               "heldout_tokens": int(len(held_ids)),
               "bytes_per_token": round(nbytes / len(train_ids), 3),
               "corpus": {"gsm8k_docs": len(gdocs), "gsm8k_mb": round(sum(map(len, gdocs)) / 1e6, 2),
                          "python_files": len(pdocs), "python_mb": round(sum(map(len, pdocs)) / 1e6, 2)}}
    order = [("draft", args.draft, args.draft_minutes, args.draft_lr),
             ("target", args.target, args.target_minutes, args.target_lr)]
    for name, spec, minutes, lr in order:
        if args.only not in ("both", name):
            continue
        h, l, nh, inter = (int(v) for v in spec.split(","))
        torch.manual_seed(args.seed + (0 if name == "draft" else 1))
        model = make_model(h, l, nh, inter, vocab, eos_id, args.max_pos)
        if args.init_from:
            from transformers import AutoModelForCausalLM

            src = Path(args.init_from) / name
            if (json.loads((src / "tokenizer.json").read_text())["model"]
                    != json.loads(tok.to_str())["model"]):
                raise SystemExit(f"tokenizer of {src} differs from the one trained here")
            model.load_state_dict(AutoModelForCausalLM.from_pretrained(
                src, dtype=torch.float32).state_dict())
            print(f"[{name}] warm start from {src}", flush=True)
        res = train_model(name, model, train_ids, val_batches, args, minutes, lr, out, saver(name))
        saver(name)(model)
        # quantisation check: held-out loss after rounding weights to fp16 / bf16
        for dt in (torch.float16, torch.bfloat16):
            m2 = make_model(h, l, nh, inter, vocab, eos_id, args.max_pos)
            m2.load_state_dict({k: v.to(dt).float() for k, v in model.state_dict().items()})
            res[f"heldout_loss_{str(dt).split('.')[-1]}_weights"] = round(heldout_loss(m2, val_batches), 4)
        res["arch"] = {"hidden": h, "layers": l, "heads": nh, "intermediate": inter}
        summary[name] = res
        print(f"[{name}] {res}", flush=True)
        (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    summary["total_seconds"] = round(time.time() - t_start, 1)
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"all done in {time.time() - t_start:.0f}s", flush=True)


def distill_main(args, out: Path, train_ids, held_ids, eos_id: int, nbytes: int,
                 t_start: float) -> int:
    """Run the distillation stage and write ``<out>/draft/`` and ``<out>/train_summary.json``.

    The draft directory gets the target's tokenizer and generation config files copied byte for
    byte; the summary keeps the target's entry of the target's ``train_summary.json`` (if it sits
    next to ``TARGET_DIR``) and records the distilled draft under ``draft``.
    """
    import shutil

    tdir = Path(args.distill_from)

    def save(model):
        d = out / "draft"
        model.save_pretrained(d)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(tdir / f, d / f)

    prev_path = tdir.parent / "train_summary.json"
    summary = json.loads(prev_path.read_text()) if prev_path.exists() else {}
    if "draft" in summary and "draft_before_distillation" not in summary:
        summary["draft_before_distillation"] = summary.pop("draft")
    summary["distill_args"] = vars(args)
    summary["distill_corpus"] = {"train_tokens": int(len(train_ids)),
                                 "heldout_tokens": int(len(held_ids)),
                                 "bytes_per_token": round(nbytes / len(train_ids), 3)}
    res = distill_draft(args, train_ids, held_ids, out, eos_id, save)
    summary["draft"] = res
    summary["distill_total_seconds"] = round(time.time() - t_start, 1)
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"all done in {time.time() - t_start:.0f}s (this run)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
