"""How far a bfloat16 model's logits move, run as the engine runs it on the CPU, against Hugging Face.

    python scripts/bf16_logit_gap.py            # bundled pair, 5 random 40-token prompts, ~10 s

Where the compiled kernels run, the engine computes a small bfloat16 model in float32 over its bf16
weight values (``gbv.engine.lean.bf16_weights_in_float32_reason``). For each model of the bundled
pair this prints the largest absolute difference of the next-token logits over every position of
the prompts between: the engine's forward of the bf16 model, Hugging Face's bf16 forward, and Hugging
Face's float32 forward of the float32 checkpoint, plus how often the argmax tokens agree. Where the
CPU has AMX-BF16 the engine's products round their inputs to bfloat16 (``host_kernels.amx_products``);
there both engines are printed: with the AMX products, and with the AVX tiles, exact in x.
"""
from __future__ import annotations

import torch

from gbv.engine import host_kernels
from gbv.engine.lean import LeanCausalLM
from gbv.models.loading import load_pair


def main() -> None:
    torch.set_num_threads(1)
    half, full = load_pair("bundled", dtype="bfloat16"), load_pair("bundled", dtype="float32")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (1, 40), generator=generator) for _ in range(5)]
    print("| model | engine | engine vs HF fp32 | HF bf16 vs HF fp32 | engine vs HF bf16 "
          "| argmax = HF fp32's: engine / HF bf16 |")
    print("|---|---|---:|---:|---:|---:|")
    default = host_kernels.amx_products()
    engines = {"AMX products (x rounded to bf16)": True, "AVX tiles (x exact)": False} if default else {
        "bf16 in fp32": False}
    for name, engine in ((name, engine) for name in ("target", "draft") for engine in engines):
        model, reference = getattr(half, name), getattr(full, name)
        if default:  # (the kind the weights are packed as when the lean view is made)
            host_kernels.set_amx_products(engines[engine])
        lean = LeanCausalLM(model)
        if default:
            host_kernels.set_amx_products(True)
        if not lean.bf16_in_float32:
            raise SystemExit("bfloat16 does not run in float32 here (no compiled kernels?)")
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
