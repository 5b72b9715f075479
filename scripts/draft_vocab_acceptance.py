"""What a draft restricted to the most frequent tokens would keep: token-level acceptance with the draft's law cut to
the N most frequent tokens and renormalised (as a draft whose head scores only those rows would draw), offline.

    python scripts/draft_vocab_acceptance.py                                   # bundled pair, N = 512,1024,2048
    python scripts/draft_vocab_acceptance.py --target DIR --draft DIR --sizes 16384,32768

A draft step's head reads one row of weights per vocabulary token (on the bundled draft, 4,096 x 256 of its 1.9 M
weights); restricting the draft to frequent tokens (as FR-Spec does for 128k vocabularies) cuts that, and stays
lossless (the verifier is given the law the drafts were drawn from), but a drafted token can no longer be one the
target wants outside the set. Token frequencies are counted on prompts the evaluation does not use (GSM8K from
``--prompts``, HumanEval from ``--prompts``, up to ``--count-prompts`` of each); the evaluation samples 128 tokens
from the target (``ar``, the same seed per prompt) on the first ``--prompts`` of each set and scores every position:
the per-token acceptance sum_x min(p(x), q(x)) with the full draft and with the cut one, and the target's mass
outside the set. docs/ENGINE.md, "Where `auto` loses, by reason (fifty-second session)".
"""
from __future__ import annotations

import argparse
import collections

import torch

from gbv.data import load_prompts

from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="bundled")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--sizes", default="512,1024,2048", help="N, comma-separated")
    parser.add_argument("--temperature", default="1.0,0.2")
    parser.add_argument("--prompts", type=int, default=10, help="evaluation prompts per data set")
    parser.add_argument("--count-prompts", type=int, default=200, help="prompts per data set counted for frequencies")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    pair = load_pair(args.target, args.draft)
    if pair.tokenizer is None or pair.draft is None:
        raise SystemExit("needs a pair with a draft and a tokenizer")
    tokenizer = pair.tokenizer
    counted = (load_prompts("gsm8k", args.count_prompts)[args.prompts:]
               + load_prompts("humaneval", args.count_prompts)[args.prompts:])
    frequency = collections.Counter(t for text in counted for t in tokenizer(text)["input_ids"])
    vocab = min(pair.target.config.vocab_size, pair.draft.config.vocab_size)
    order = sorted(range(vocab), key=lambda t: -frequency.get(t, 0))
    sizes = [int(n) for n in args.sizes.split(",")]
    kept = {n: torch.zeros(vocab, dtype=torch.bool) for n in sizes}  # (each size's set: its N most frequent tokens)
    for n, mask in kept.items():
        mask[order[:n]] = True
    print(f"{len(counted)} prompts counted: {sum(1 for t in range(vocab) if frequency.get(t, 0))} of {vocab} tokens seen\n")
    print("| T | full draft | " + " | ".join(f"N = {n} | target mass outside" for n in sizes) + " |")
    print("|---:|---:|" + "---:|---:|" * len(sizes))
    evaluated = benchmark_prompts(args.prompts)
    for temperature in (float(t) for t in args.temperature.split(",")):
        sums = collections.defaultdict(float)
        positions = 0
        for seed, text in enumerate(evaluated):
            ids = tokenizer(text)["input_ids"]
            out = generate(pair, prompt_ids=ids, method="ar", max_new_tokens=128, seed=seed, temperature=temperature,
                           eos_token_id=[])
            sequence = torch.tensor([ids + out.token_ids])
            with torch.inference_mode():
                p = (pair.target(sequence).logits[0, len(ids) - 1:-1, :vocab].float() / temperature).softmax(-1)
                q = (pair.draft(sequence).logits[0, len(ids) - 1:-1, :vocab].float() / temperature).softmax(-1)
            positions += p.shape[0]
            sums["full"] += torch.minimum(p, q).sum().item()
            for n in sizes:
                cut = torch.where(kept[n], q, torch.zeros_like(q))
                cut = cut / cut.sum(-1, keepdim=True)
                sums[n] += torch.minimum(p, cut).sum().item()
                sums[n, "outside"] += p[:, ~kept[n]].sum().item()
        cells = " | ".join(f"{sums[n] / positions:.3f} | {sums[n, 'outside'] / positions:.3f}" for n in sizes)
        print(f"| {temperature} | {sums['full'] / positions:.3f} | {cells} |")


if __name__ == "__main__":
    main()
