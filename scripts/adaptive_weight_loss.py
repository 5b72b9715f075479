"""How much one-step acceptance gbv-adaptive's node weights lose to their shortcuts, on the bundled pair.

    python scripts/adaptive_weight_loss.py            # 3 GSM8K + 3 HumanEval prompts, K = 4, L = 4, ~1 min

From V = 4096 up, the host form's node weights (``gbv_adaptive.host_node_weights``) work on less than
the row: a sharp row cut to its tokens of non-negligible q, a flat row's key buckets standing for its
tokens (``gbv.verify.ranking.occupied_bucket_masses``). Losslessness does not depend on the weight,
only the acceptance does. For every node weight computed while decoding, this script recomputes the
weight on the whole row with the exact ``W``. It evaluates the node's one-step acceptance
``F(lam) = sum_x min(p_x, (1 - lam) q_x + lam g_n(x))`` (with the exact ``W``) at both weights, and
reports the mean and worst loss ``F(exact weight) - F(weight used)`` per temperature.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from gbv.verify import gbv_adaptive, ranking
from prompt_sets import benchmark_prompts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=3, help="GSM8K and HumanEval prompts each")
    parser.add_argument("--num-paths", type=int, default=4)
    parser.add_argument("--block-len", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pair = load_pair("bundled")
    weights = gbv_adaptive.host_node_weights
    records: list[tuple[float, float]] = []  # (F at the weight used, F at the exact weight)

    def recording_weights(p64, q64, key, num_paths):
        lams = weights(p64, q64, key, num_paths)
        p64, q64 = torch.as_tensor(p64), torch.as_tensor(q64)  # the host form passes numpy rows
        exact_below = ranking.mass_below_rows(torch.as_tensor(key)[None], q64[None])[0]
        exact = gbv_adaptive.node_weights(p64, q64, exact_below, num_paths)
        for n in range(2, num_paths + 1):
            g = gbv_adaptive.greedy_step_law(exact_below, q64, n)
            value = lambda lam: float(torch.minimum(p64, (1 - lam) * q64 + lam * g).sum())  # noqa: E731
            records.append((value(lams[n]), value(exact[n])))
        return lams

    gbv_adaptive.host_node_weights = recording_weights  # verify_gbv_adaptive looks it up at call time
    prompts = benchmark_prompts(args.prompts)
    try:
        for temperature in (0.2, 1.0):
            records.clear()
            for seed, prompt in enumerate(prompts):
                generate(pair, prompt=prompt, method="gbv-adaptive", num_paths=args.num_paths,
                         block_len=args.block_len, temperature=temperature, max_new_tokens=args.max_new_tokens,
                         eos_token_id=[], seed=seed)
            losses = [exact - bucketed for bucketed, exact in records]
            print(f"T={temperature}: {len(records)} node weights; F lost to the shortcuts: mean {statistics.mean(losses):.2e}, "
                  f"worst {max(losses):.2e}; mean F {statistics.mean(e for _, e in records):.4f}")
    finally:
        gbv_adaptive.host_node_weights = weights


if __name__ == "__main__":
    main()
