"""How far a bfloat16 model's logits move, run as the engine runs it on the CPU, against Hugging Face.

    python scripts/bf16_logit_gap.py                    # bundled pair, 5 random 40-token prompts, ~10 s
    python scripts/bf16_logit_gap.py --dtype float16    # the same for float16

Where the compiled kernels run, the engine computes a small bfloat16 model in float32 over its bf16
weight values (``gbv.engine.lean.bf16_weights_in_float32_reason``). For each model of the bundled
pair this prints the largest absolute difference of the next-token logits over every position of
the prompts between: the engine's forward of the bf16 model, Hugging Face's bf16 forward, and Hugging
Face's float32 forward of the float32 checkpoint, plus how often the argmax tokens agree. Where the
CPU has AMX-BF16 the engine's products round their inputs to bfloat16 (``host_kernels.amx_products``);
there both engines are printed: with the AMX products, and with the AVX tiles, exact in x.

``--dtype float16``: a float16 model, which the engine also computes in float32, its matrices as float16 panels,
the copies a norm's weight is folded into rounded to float16 values (``host_kernels.f16_panels``); printed with
those panels and with float32 ones of the unrounded copies (``GBV_HOST_F16_PANELS=0``).
"""
from __future__ import annotations

import argparse
import os

import torch

from gbv.engine import host_kernels
from gbv.engine.lean import LeanCausalLM
from gbv.models.loading import load_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    half, full = load_pair("bundled", dtype=args.dtype), load_pair("bundled", dtype="float32")
    short = "bf16" if args.dtype == "bfloat16" else "fp16"
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (1, 40), generator=generator) for _ in range(5)]
    print(f"| model | engine | engine vs HF fp32 | HF {short} vs HF fp32 | engine vs HF {short} "
          f"| argmax = HF fp32's: engine / HF {short} |")
    print("|---|---|---:|---:|---:|---:|")
    default = host_kernels.amx_products() and args.dtype == "bfloat16"
    if args.dtype == "float16":
        engines = {"fp16 panels (folded copies rounded to fp16)": "1", "fp32 panels": "0"}
    else:
        engines = {"AMX products (x rounded to bf16)": True, "AVX tiles (x exact)": False} if default else {
            "bf16 in fp32": False}
    for name, engine in ((name, engine) for name in ("target", "draft") for engine in engines):
        model, reference = getattr(half, name), getattr(full, name)
        if default:  # (the kind the weights are packed as when the lean view is made)
            host_kernels.set_amx_products(engines[engine])
        if args.dtype == "float16":
            os.environ["GBV_HOST_F16_PANELS"] = engines[engine]
        lean = LeanCausalLM(model)
        if default:
            host_kernels.set_amx_products(True)
        if not (lean.bf16_in_float32 or lean.fp16_in_float32):
            raise SystemExit(f"{args.dtype} does not run in float32 here (no compiled kernels?)")
        gaps = {"engine": 0.0, "hf": 0.0, "between": 0.0}
        same = {"engine": 0, "hf": 0}
        positions = 0
        with torch.inference_mode():
            for tokens in prompts:
                ours = lean.forward(tokens, torch.arange(40)[None], 0, lean.new_cache(1, 64), None, causal=True)[0]
                hf_half = model(input_ids=tokens).logits[0].float()
                hf_full = reference(input_ids=tokens).logits[0]
                gaps["engine"] = max(gaps["engine"], float((ours - hf_full).abs().max()))
                gaps["hf"] = max(gaps["hf"], float((hf_half - hf_full).abs().max()))
                gaps["between"] = max(gaps["between"], float((ours - hf_half).abs().max()))
                best = hf_full.argmax(-1)
                same["engine"] += int((ours.argmax(-1) == best).sum())
                same["hf"] += int((hf_half.argmax(-1) == best).sum())
                positions += best.numel()
        print(f"| {name} | {engine} | {gaps['engine']:.4f} | {gaps['hf']:.4f} | {gaps['between']:.4f} | "
              f"{same['engine'] / positions:.1%} / {same['hf'] / positions:.1%} |")


if __name__ == "__main__":
    main()
