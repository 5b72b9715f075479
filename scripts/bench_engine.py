"""Benchmark the engine: tokens/s and block efficiency per method, against HF generation, one run.

    python scripts/bench_engine.py                      # synthetic random Llama pair (below)
    python scripts/bench_engine.py --bundled            # also the bundled pair on a GSM8K prompt

Synthetic pair (nothing trained, nothing downloaded): target = random Llama, hidden 256 x 8 layers,
vocab 2048, untied head scaled by 3 (so its next-token law is not uniform: mean entropy about 7.2 nats
against 7.6 for uniform); draft = a truncated copy of the target (its embeddings, first layer, final
norm and head: 256 x 1), which agrees with the target only partly (token-level acceptance about 0.5).
Prompt: 64 random token ids. Methods run round-robin within each repeat; besides wall-clock tokens/s
the table gives tokens per CPU-second of this process (fairer when the machine is shared). Every method samples ``--max-new-tokens`` tokens at temperature 1 with
the same seeds; HF assisted generation uses the same draft with ``num_assistant_tokens = L`` (constant
schedule) and ``do_sample=True``; HF plain is ``target.generate(do_sample=True)``. HF's target calls
are counted with a forward hook (HF's first call covers the prompt and yields a token, so it counts;
our prefill stops before the last prompt token and yields nothing, so it does not). Reported: medians over ``--repeats`` runs (seeds 0..repeats-1),
``torch.set_num_threads(1)``. Block efficiency = new tokens / target calls (prefill not counted).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from gbv.engine.generate import generate
from gbv.models.loading import ModelPair


def synthetic_pair(seed: int = 0, head_scale: float = 3.0) -> ModelPair:
    from transformers import LlamaConfig, LlamaForCausalLM

    def config(layers: int) -> LlamaConfig:
        return LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                           tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)

    torch.manual_seed(seed)
    target = LlamaForCausalLM(config(8)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(head_scale)
    draft = LlamaForCausalLM(config(1)).eval()
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers[0] = target.model.layers[0]
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    return ModelPair(target, draft, names=("random-llama-256x8", "truncated-copy-256x1"))


class CallCounter:
    def __init__(self, model) -> None:
        self.calls = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *args) -> None:
        self.calls += 1


def run_ours(pair, prompt_ids, method, k, block_len, max_new, seed, temperature) -> dict:
    cpu = time.process_time()
    out = generate(pair, prompt_ids=prompt_ids, method=method, num_paths=k, block_len=block_len,
                   temperature=temperature, max_new_tokens=max_new, eos_token_id=[], seed=seed)
    cpu = time.process_time() - cpu
    s = out.stats
    return {"tokens/s": s.tokens_per_second, "tokens/cpu-s": s.new_tokens / cpu, "block eff.": s.block_efficiency,
            "draft s": s.time_draft, "target s": s.time_target, "verify s": s.time_verify, "other s": s.time_other}


def run_hf(pair, prompt_ids, block_len, max_new, seed, temperature, assisted: bool) -> dict:
    target, draft = pair.target, pair.draft
    ids = torch.tensor([prompt_ids])
    kwargs = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new,
                  min_new_tokens=max_new, pad_token_id=0)
    if assisted:
        draft.generation_config.num_assistant_tokens = block_len
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = draft
    torch.manual_seed(seed)
    counter = CallCounter(target)
    try:
        start, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = target.generate(ids, **kwargs)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        counter.handle.remove()
    new = out.shape[1] - ids.shape[1]
    # HF's first call covers the prompt and yields a token, so it counts.
    return {"tokens/s": new / elapsed, "tokens/cpu-s": new / cpu, "block eff.": new / max(1, counter.calls)}


def run(pair, prompt_ids, args, title: str) -> str:
    k, block_len = args.num_paths, args.block_len
    configs = {"ar": ("ar", 1)}
    for method in ("token", "block", "specinfer", "spectr", "traversal", "gbv"):
        paths = 1 if method in ("token", "block") else k
        configs[f"{method} (K={paths}, L={block_len})"] = (method, k)
    labels = list(configs) + [f"HF assisted (L={block_len})", "HF plain generate"]
    rows: dict[str, list[dict]] = {label: [] for label in labels}
    # Warm-up (first calls pay for lazy initialisation).
    generate(pair, prompt_ids=prompt_ids, method="gbv", num_paths=2, block_len=2, max_new_tokens=8, eos_token_id=[])
    # Round-robin over methods within each repeat, so that load drifts on a shared machine hit all alike.
    for seed in range(args.repeats):
        for label, (method, paths) in configs.items():
            rows[label].append(run_ours(pair, prompt_ids, method, paths, block_len, args.max_new_tokens, seed,
                                        args.temperature))
        rows[labels[-2]].append(run_hf(pair, prompt_ids, block_len, args.max_new_tokens, seed, args.temperature, True))
        rows[labels[-1]].append(run_hf(pair, prompt_ids, block_len, args.max_new_tokens, seed, args.temperature, False))
        print(f"  repeat {seed + 1}/{args.repeats} done", file=sys.stderr)
    med = {label: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for label, rs in rows.items()}
    base_wall, base_cpu = med["ar"]["tokens/s"], med["ar"]["tokens/cpu-s"]
    lines = [f"**{title}** ({args.max_new_tokens} new tokens, temperature {args.temperature}, "
             f"median of {args.repeats}, one thread)", "",
             "| method | tokens/s | vs ar | tokens/CPU-s | vs ar (CPU) | block efficiency | draft s | target s | verify s | other s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, row in med.items():
        extra = " | ".join(f"{row[c]:.3f}" if c in row else "-" for c in ("draft s", "target s", "verify s", "other s"))
        lines.append(f"| {label} | {row['tokens/s']:.1f} | {row['tokens/s'] / base_wall:.2f}x | "
                     f"{row['tokens/cpu-s']:.1f} | {row['tokens/cpu-s'] / base_cpu:.2f}x | {row['block eff.']:.2f} | {extra} |")
    return "\n".join(lines)


def gsm8k_prompt(tokenizer) -> list[int]:
    text = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
            "in May. How many clips did Natalia sell altogether in April and May?\nAnswer:")
    try:  # a prompt from the packaged GSM8K set when available
        from gbv.data import load_prompts

        text = load_prompts("gsm8k", limit=1)[0]
    except Exception:  # noqa: BLE001 - fall back to the built-in GSM8K question
        pass
    return tokenizer(text)["input_ids"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-paths", type=int, default=3)
    parser.add_argument("--block-len", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--head-scale", type=float, default=3.0,
                        help="scale of the synthetic target's head (lower = closer to uniform = more agreement)")
    parser.add_argument("--bundled", action="store_true", help="also run the bundled pair on a GSM8K prompt")
    parser.add_argument("--skip-synthetic", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.skip_synthetic:
        pair = synthetic_pair(head_scale=args.head_scale)
        prompt = torch.randint(0, 2048, (64,), generator=torch.Generator().manual_seed(1)).tolist()
        print(run(pair, prompt, args, "Synthetic pair: random Llama 256x8 target (head x"
                  f"{args.head_scale:g}), truncated-copy 256x1 draft, vocab 2048"))
        print()
    if args.bundled:
        from gbv.models.loading import load_pair

        pair = load_pair("bundled")
        print(run(pair, gsm8k_prompt(pair.tokenizer), args, "Bundled pair, GSM8K prompt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
