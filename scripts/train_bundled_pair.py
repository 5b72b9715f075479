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

Example (what produced the bundled pair)::

    nohup python3 scripts/train_bundled_pair.py --out scratch/pair \\
        --batch-size 8 --draft-minutes 10 --target-minutes 47 --eval-every-s 90 \\
        --heldout-batches 2 > scratch/train.log 2>&1 &
    python3 scripts/train_bundled_pair.py --package scratch/pair gbv/models/bundled
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
        warm = min(1.0, (step + 1) / args.warmup_steps)
        cos = args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac))
        cur_lr = lr * warm * cos
        for g in opt.param_groups:
            g["lr"] = cur_lr
        starts = rng.integers(0, len(train_ids) - T - 1, size=B)
        x = torch.from_numpy(np.stack([train_ids[s:s + T + 1] for s in starts]).astype(np.int64))
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += B * T
        li = loss.item()
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


def package(src: Path, dest: Path, dtype: str = "float16") -> None:
    """Copy a trained pair from ``src`` to ``dest`` (e.g. ``gbv/models/bundled``).

    Weights are stored in ``dtype`` to halve the size, but ``config.json`` keeps
    ``"dtype": "float32"`` so that ``from_pretrained`` (default ``dtype="auto"``) upcasts them on
    load: half-precision matmuls are slow on CPU.
    """
    import shutil

    from transformers import AutoModelForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("target", "draft"):
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
    args = ap.parse_args(argv)
    if args.package:
        package(Path(args.package[0]), Path(args.package[1]))
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


if __name__ == "__main__":
    sys.exit(main())
