"""Tune and check ``method="auto"`` offline: record every arm's iterations, then replay the policy.

    python scripts/auto_replay.py collect traces.json --prompts 10 --temperature 0.2,1.0   # ~7 min, 1 thread
    python scripts/auto_replay.py replay traces.json --seeds 40
    python scripts/auto_replay.py replay traces.json --age 1     # the policy without aging
    python scripts/auto_replay.py pooled traces.json             # BV arms' own means against the pooled estimate
    python scripts/auto_replay.py drift                          # aging (auto._AGE) on synthetic arms

``collect`` runs each arm of :func:`gbv.engine.auto.default_arms` as a fixed choice on the bundled pair
(N GSM8K + N HumanEval prompts, 128 tokens, EOS off; arms round-robin per prompt) and stores every
iteration's (tokens committed, seconds), in order, per arm and prompt.

``replay`` runs :class:`gbv.engine.auto.AutoPolicy` over those traces instead of the models: each
simulated prompt replays one recorded prompt, and each arm's iterations come in the order they were
recorded, so the hard stretches of a prompt stay together (as they do for the real policy). It
reports the policy's tokens/s over 40 prompts as a share of the best arm's, median and worst over
the seeds (prompt orders): the policy's exploration and its wrong turns, without the noise of a
model run. The model benchmark (scripts/bench_engine.py) remains the measurement that counts.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import random
import statistics
import sys

from gbv.engine import auto


def collect(args) -> None:
    import torch

    from prompt_sets import benchmark_prompt_ids
    from gbv.engine.generate import generate
    from gbv.models.loading import load_pair

    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    ids = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    arms = auto.default_arms(False, True)
    forced, log = {"index": 0}, []

    class Forced(auto.AutoPolicy):
        """Always the forced arm (``ar`` where its block no longer fits); logs that arm's iterations."""

        def choose(self, max_block=None):
            index = forced["index"]
            return 0 if max_block is not None and self.arms[index].block_len > max_block else index

        def defer(self, index, tokens, seconds, switching=0.0):  # (AutoDecoder's record of an iteration)
            if index == forced["index"]:
                log.append((tokens, seconds))

    auto.AutoPolicy = Forced  # policy_for builds the policies of the runs below
    traces = {}
    for temperature in [float(t) for t in args.temperature.split(",")]:
        generate(pair, prompt_ids=ids[0], method="auto", temperature=temperature, max_new_tokens=16, eos_token_id=[])
        per_arm = {arm.label: [] for arm in arms}
        for seed, prompt_ids in enumerate(ids):
            for index, arm in enumerate(arms):
                forced["index"] = index
                log.clear()
                generate(pair, prompt_ids=prompt_ids, method="auto", temperature=temperature,
                         max_new_tokens=args.max_new_tokens, eos_token_id=[], seed=seed)
                per_arm[arm.label].append(list(log))
            print(f"T={temperature}: prompt {seed + 1}/{len(ids)}", file=sys.stderr)
        traces[str(temperature)] = per_arm
    with open(args.file, "w") as f:
        json.dump({"arms": [dict(method=arm.method, num_paths=arm.num_paths, block_len=arm.block_len) for arm in arms], "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                   "traces": traces}, f)


def simulate(arms: list[auto.Arm], traces: dict, prompts: int, max_new: int, seed: int, aligned: bool = True) -> float:
    """Tokens/s of a fresh policy over ``prompts`` replayed prompts.

    ``aligned`` (the default): at text position ``n`` of a replayed prompt, an arm replays the
    iteration of its own recording of that prompt that started nearest to ``n``, so
    the arms' tries follow one another along the text as in a real run (the start of an answer is
    harder to draft than its middle: at T = 0.2 a first BV L = 8 iteration commits about half the
    tokens of a later one). Otherwise each arm replays its recording from the start, in order, which
    gives the prompt's hard start to every arm that is seldom run.
    """
    rnd = random.Random(seed)
    policy = auto.AutoPolicy(arms)
    recorded = len(traces[arms[0].label])
    order = list(range(recorded))
    rnd.shuffle(order)
    starts = {label: [list(itertools.accumulate((t for t, _ in prompt), initial=0))[:-1] for prompt in per_prompt]
              for label, per_prompt in traces.items()}
    total_tokens, total_seconds = 0, 0.0
    longest = max(arm.block_len for arm in arms)
    for n in range(prompts):
        source = order[n] if n < recorded else rnd.randrange(recorded)
        position = {arm.label: 0 for arm in arms}
        made = 0
        while made < max_new:
            room = max_new - made - 1  # as in generate: the block must leave room for its bonus token
            index = policy.choose(room if room < longest else None)
            label = arms[index].label
            trace = traces[label][source]
            if aligned:
                # The recorded iteration that started nearest to ``made``, either side. (The latest one
                # at or before it, credited in full, counted the tokens between its start and ``made``
                # twice: auto at 1.00-1.04x the best arm; crediting only the tokens past ``made``
                # undercounts as much: 0.92x.)
                begun = starts[label][source]
                at = bisect.bisect_right(begun, made) - 1
                if at + 1 < len(begun) and begun[at + 1] - made < made - begun[at]:
                    at += 1
                tokens, seconds = trace[at]
            else:
                at = position[label] % len(trace)
                position[label] += 1
                tokens, seconds = trace[at]
            policy.record(index, tokens, seconds)
            made += tokens
            total_tokens += tokens
            total_seconds += seconds
    return total_tokens / total_seconds


def replay(args) -> None:
    if args.depth_prior is not None:
        auto._PRIOR_DEPTH_TRIALS = args.depth_prior
    if args.age is not None:
        auto._AGE = args.age
    if args.acceptance_decay is not None:
        auto._ACCEPTANCE_DECAY = args.acceptance_decay
    with open(args.file) as f:
        data = json.load(f)
    arms = [auto.Arm(arm["method"], arm["num_paths"], arm["block_len"]) for arm in data["arms"]]
    for temperature, traces in data["traces"].items():
        rates = {arm.label: sum(t for prompt in traces[arm.label] for t, _ in prompt)
                 / sum(s for prompt in traces[arm.label] for _, s in prompt) for arm in arms}
        best = max(rates, key=rates.get)
        aligned = not args.unaligned
        shares = sorted(simulate(arms, traces, args.prompts, data["max_new_tokens"], seed, aligned) / rates[best]
                        for seed in range(args.seeds))
        top = ", ".join(f"{label} {rate:.0f}" for label, rate in sorted(rates.items(), key=lambda kv: -kv[1])[:4])
        print(f"T={temperature}: auto = {statistics.median(shares):.3f}x the best arm (median of {args.seeds}), "
              f"10th percentile {shares[len(shares) // 10]:.3f}x, worst {shares[0]:.3f}x; "
              f"arms (tokens/s): {top}, ar {rates['ar']:.0f}")


def pooled(args) -> None:
    """Each BV arm's own tokens per iteration (run alone) against the estimate of the acceptance pooled
    over every BV length, as ``auto`` rates it (all iterations counted once, no decay)."""
    with open(args.file) as f:
        data = json.load(f)
    arms = [auto.Arm(arm["method"], arm["num_paths"], arm["block_len"]) for arm in data["arms"]]
    blocks = [arm for arm in arms if arm.method == "block"]
    decay, auto._ACCEPTANCE_DECAY = auto._ACCEPTANCE_DECAY, 1.0
    try:
        for temperature, traces in data["traces"].items():
            family = auto._Acceptance()
            family.grow(max(arm.block_len for arm in blocks))
            own = {}
            for arm in blocks:
                made = [tokens for prompt in traces[arm.label] for tokens, _ in prompt]
                own[arm.block_len] = sum(made) / len(made)
                for tokens in made:
                    family.record(min(tokens - 1, arm.block_len), arm.block_len)
            print(f"T={temperature}: " + "; ".join(
                f"L={length} own {mean:.2f}, pooled {family.expected_tokens(length):.2f} "
                f"({family.expected_tokens(length) / mean - 1:+.1%})" for length, mean in own.items()))
    finally:
        auto._ACCEPTANCE_DECAY = decay


def drift(args) -> None:
    """Synthetic arms, no models: what aging the estimates (``auto._AGE``) costs where nothing drifts, and
    how soon the policy follows an arm that became faster. ``ar`` makes 1 token in 1 ms; BV L = 2 makes
    2.5 tokens (2 and 3 in turn) in ``x`` ms, BV L = 3 3.5 tokens in 1.3x ms."""
    for age in [float(a) for a in args.ages.split(",")]:
        auto._AGE = age
        costs = []
        for block_ms in (2.58, 2.8, 2.9):  # BV L = 2 3%, 11% and 14% behind ar, for 5,000 iterations
            policy = auto.AutoPolicy([auto.Arm("ar", 0, 0), auto.Arm("block", 1, 2), auto.Arm("block", 1, 3)])
            tokens, seconds = 0, 0.0
            for turn in range(5000):
                index = policy.choose()
                made = 1 if index == 0 else (2 + turn % 2 if index == 1 else 3 + turn % 2)
                took = 0.001 if index == 0 else block_ms / 1000 * (1.0 if index == 1 else 1.3)
                policy.record(index, made, took)
                tokens, seconds = tokens + made, seconds + took
            costs.append(f"{1 - tokens / seconds / 1000:.2%}")
        policy = auto.AutoPolicy([auto.Arm("ar", 0, 0), auto.Arm("block", 1, 2)])
        chosen = []
        for turn in range(3400):  # BV L = 2 at 890 tokens/s for 400 iterations, then at 1,250
            index = policy.choose()
            policy.record(index, 1 if index == 0 else 2 + turn % 2, 0.001 if index == 0 else
                          (0.0028 if turn < 400 else 0.002))
            if turn >= 400:
                chosen.append(index)
        found = next((n for n in range(len(chosen)) if chosen[n:n + 50].count(1) >= 45), None)
        print(f"_AGE = {age}: tokens/s lost against ar where BV is 3% / 11% / 14% behind: {' / '.join(costs)}; "
              f"after BV L = 2 became 25% faster than ar: BV in {chosen[-1000:].count(1) / 10:.0f}% of the last "
              f"1,000 of 3,000 choices, 45 of 50 choices from iteration {found}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="record every arm's iterations on the bundled pair")
    c.add_argument("file")
    c.add_argument("--prompts", type=int, default=10, help="GSM8K and HumanEval prompts each (default 10)")
    c.add_argument("--temperature", default="0.2,1.0")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--dtype", default="float32", help="the pair's dtype (default float32)")
    r = sub.add_parser("replay", help="replay the auto policy over recorded traces")
    r.add_argument("file")
    r.add_argument("--seeds", type=int, default=40)
    r.add_argument("--prompts", type=int, default=40, help="prompts per replayed run (default 40)")
    r.add_argument("--unaligned", action="store_true",
                   help="replay each arm's recording from its start instead of at the text position")
    r.add_argument("--depth-prior", type=float, default=None,
                   help="override auto._PRIOR_DEPTH_TRIALS (1e-9 replays the rule without the prior)")
    r.add_argument("--age", type=float, default=None,
                   help="override auto._AGE (1 replays the policy whose estimates do not age)")
    r.add_argument("--acceptance-decay", type=float, default=None,
                   help="override auto._ACCEPTANCE_DECAY (0.99 replays the rule before the twenty-ninth session)")
    p = sub.add_parser("pooled", help="each BV arm's own tokens per iteration against the pooled estimate")
    p.add_argument("file")
    d = sub.add_parser("drift", help="aging the estimates on synthetic arms (no models)")
    d.add_argument("--ages", default="0.999,0.9995,1", help="values of auto._AGE to compare")
    args = parser.parse_args(argv)
    {"collect": collect, "replay": replay, "pooled": pooled, "drift": drift}[args.command](args)


if __name__ == "__main__":
    main()
