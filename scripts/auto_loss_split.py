"""Where ``auto`` loses against the best fixed row, by the reason of each iteration, in one process (1 thread,
bundled pair).

    python scripts/auto_loss_split.py --dtype bfloat16 --temperature 0.2        # 3 passes over 20 prompts, ~2 min
    python scripts/auto_loss_split.py --dtype float32 --temperature 1.0 --passes 2
    python scripts/auto_loss_split.py --dtype bfloat16 --temperature 1.0 --rates --set _HOLD=32

Each pass runs every prompt (GSM8K and HumanEval, 128 new tokens, EOS off, the same seed per prompt) through the
fixed rows (``--rows``) and ``auto``, in alternating order per prompt; ``auto``'s policy learns over the passes, as
in a server process. Wrappers time each iteration of the tree decoder (``step``; ``plain_steps``, a run of ``ar``
steps) and the draft's catch-ups, and label each of ``auto``'s iterations by why its arm ran:

- ``leader``: ``choose`` picked the arm it rates best; ``held``: the leader kept without a choice (``auto._HOLD``, and
  ``ar``'s stretches, ``auto._STRETCH``); ``trial``: ``choose`` picked another arm (UCB's bonus); ``explore``: an arm
  still on its first trials (``auto._MIN_TRIALS``); ``tail``: a generation's last token or two, where only ``ar`` fits;
- ``switch-in``: the arm differs from the iteration before it in the generation (or is its first).

The best fixed row of the pass (the most tokens per second of wall time) is the reference: ``auto``'s loss against
it, in ms at ``auto``'s tokens, is split exactly into each label's excess (its iterations' time less their tokens
at the reference's iteration time per token), the draft's catch-ups after ``ar`` (its deferred prompt is prefill,
outside every row's wall time here), and the rest of the wall time (the policy, ``AutoDecoder``, the generate loop)
less the reference's own rest per token. Iteration times vary by the machine's moments; only one pass's rows, run
interleaved, compare. docs/ENGINE.md, "Where `auto` loses, by reason (fifty-second session)".
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from gbv.engine import auto, tree_decoder
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--prompts", type=int, default=10, help="prompts per data set (GSM8K, HumanEval)")
    parser.add_argument("--passes", type=int, default=3, help="passes over the prompts (auto keeps learning)")
    parser.add_argument("--rows", default="ar,block:2,block:3,block:4", help="fixed rows: ar or block:L, comma-separated")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="set one of gbv.engine.auto's constants first (e.g. _HOLD=32); may be repeated")
    parser.add_argument("--rates", action="store_true",
                        help="after each of auto's generations, its policy's rate of each fixed row's arm against "
                             "that row's tokens/s so far in the pass")
    args = parser.parse_args(argv)
    fixed = []
    for row in args.rows.split(","):
        method, _, length = row.partition(":")
        if method not in ("ar", "block") or (method == "block") != length.isdigit():
            parser.error(f"bad row {row!r}: use ar or block:L")
        fixed.append((row, method, int(length or 1)))
    rows = fixed + [("auto", "auto", 1)]
    for setting in args.set:
        name, _, value = setting.partition("=")
        if not name.startswith("_") or not hasattr(auto, name) or not isinstance(getattr(auto, name), (int, float)):
            parser.error(f"--set {setting!r}: not a numeric constant of gbv.engine.auto")
        try:
            kind = type(getattr(auto, name))
            if kind is bool and value not in ("True", "False"):
                raise ValueError
            setattr(auto, name, value == "True" if kind is bool else kind(value))
        except ValueError:
            parser.error(f"--set {setting!r}: {value!r} is not a {type(getattr(auto, name)).__name__}")
    torch.set_num_threads(1)
    pair = load_pair("bundled", dtype=args.dtype)
    prompts = benchmark_prompt_ids(pair.tokenizer, args.prompts)
    current = {"row": "", "prompt": 0, "why": None}
    calls: list[tuple] = []  # (row, prompt, arm, tokens, seconds) of every iteration, and auto's why

    inside = [0]  # (a fixed ar row's step runs plain_steps: one iteration, timed once)

    def timed_iteration(function, arm_of):
        def wrapper(self, *a, **k):
            inside[0] += 1
            start = time.perf_counter()
            try:
                new = function(self, *a, **k)
            finally:
                inside[0] -= 1
            if not inside[0]:
                calls.append((current["row"], current["prompt"], arm_of(self, *a), len(new), time.perf_counter() - start))
            return new
        return wrapper

    catch_ups = collections.Counter()  # row -> seconds of catch-ups after plain steps (not the deferred prompt)
    prompt_feeds = collections.Counter()  # row -> seconds of the draft's deferred prompt (prefill: not in the wall)

    def timed_catch_up(function):
        def wrapper(self, *a, **k):
            prompt, start = self.draft_len == 0, time.perf_counter()
            function(self, *a, **k)
            (prompt_feeds if prompt else catch_ups)[current["row"]] += time.perf_counter() - start
        return wrapper

    policy_seconds = collections.Counter()  # row -> seconds in auto's choose and flush inside AutoDecoder.step
    in_policy, in_step = [0], [False]

    def timed_policy(function):
        def wrapper(self, *a, **k):
            in_policy[0] += 1
            start = time.perf_counter()
            try:
                return function(self, *a, **k)
            finally:
                in_policy[0] -= 1
                if not in_policy[0] and in_step[0]:  # (not the flush at a prefill: outside the wall time)
                    policy_seconds[current["row"]] += time.perf_counter() - start
        return wrapper

    def labelled_choose(function):
        def wrapper(self, *a, **k):
            index = function(self, *a, **k)
            arm = self.arms[index]
            exploring = self.runs[index] < auto._MIN_TRIALS or (
                arm.method == "ar" and self.steady_trials[index] == 0.0 and self.runs[index] < 2 * auto._MIN_TRIALS)
            current["why"] = "leader" if index == self.last_leader else "explore" if exploring else "trial"
            return index
        return wrapper

    step_seconds = collections.Counter()  # row -> seconds in AutoDecoder.step, whole

    def labelled_step(function):
        def wrapper(self, block_len=None):
            current["why"], first = None, len(calls)
            in_step[0], start = True, time.perf_counter()
            try:
                new = function(self, block_len)
            finally:
                in_step[0] = False
            step_seconds[current["row"]] += time.perf_counter() - start
            why = current["why"] or ("tail" if block_len is not None and block_len < self._shortest else "held")
            for i in range(first, len(calls)):  # (the iteration this step ran: one call)
                calls[i] = (*calls[i], why)
            return new
        return wrapper

    patches = {(tree_decoder.TreeDecoder, "step"): timed_iteration(
                   tree_decoder.TreeDecoder.step,
                   lambda self, block=None: "ar" if block == 0 or self.method == "ar" else
                   f"{self.method} L={self.block_len if block is None else min(block, self.block_len)}"),
               (tree_decoder.TreeDecoder, "plain_steps"): timed_iteration(
                   tree_decoder.TreeDecoder.plain_steps, lambda self, limit=None: "ar"),
               (tree_decoder.TreeDecoder, "catch_up_draft"): timed_catch_up(tree_decoder.TreeDecoder.catch_up_draft),
               (auto.AutoPolicy, "choose"): timed_policy(labelled_choose(auto.AutoPolicy.choose)),
               (auto.AutoPolicy, "flush"): timed_policy(auto.AutoPolicy.flush),
               (auto.AutoDecoder, "step"): labelled_step(auto.AutoDecoder.step)}
    originals = {key: getattr(*key) for key in patches}
    settings = dict(temperature=args.temperature, eos_token_id=[])
    print(f"{args.dtype}, T = {args.temperature}, {len(prompts)} prompts x 128 new tokens a pass, 1 thread; ms\n")
    try:
        for key, patched in patches.items():
            setattr(*key, patched)
        for _, method, length in fixed:  # (warm-up: first calls of each shape; auto's policy does not see these)
            generate(pair, prompt_ids=prompts[0], method=method, block_len=length, max_new_tokens=16, **settings)
        for number in range(args.passes):
            calls.clear()
            catch_ups.clear()
            policy_seconds.clear()
            step_seconds.clear()
            prompt_feeds.clear()
            wall, tokens = collections.Counter(), collections.Counter()
            for seed, prompt_ids in enumerate(prompts):
                for label, method, length in (rows if seed % 2 == 0 else rows[::-1]):
                    current["row"], current["prompt"] = label, seed
                    out = generate(pair, prompt_ids=prompt_ids, method=method, block_len=length, max_new_tokens=128,
                                   seed=seed, **settings)
                    wall[label] += out.stats.time_total  # (after the prefill, the draft's deferred prompt too)
                    tokens[label] += out.stats.new_tokens
                    if args.rates and label == "auto":
                        print_rates(pair, number, seed, fixed, wall, tokens, out.stats.auto_arms)
            report(number, rows, calls, wall, tokens, catch_ups, policy_seconds["auto"],
                   step_seconds["auto"] - prompt_feeds["auto"])
    finally:
        for key, original in originals.items():
            setattr(*key, original)


def print_rates(pair, number: int, seed: int, fixed, wall, tokens, arms) -> None:
    """The policy's rate of each fixed row's arm (at the contexts where the arm ran, at the machine's current
    speed as far as the policy knows it) against the row's tokens/s so far in this pass, and the arms auto ran."""
    policy = next(iter(auto._POLICIES[pair.target].values()))
    policy.flush()
    index = {(arm.method, arm.block_len if arm.method != "ar" else 1): i for i, arm in enumerate(policy.arms)
             if arm.num_paths <= 1}
    cells = []
    for label, method, length in fixed:
        mine = policy.rate(index[method, length]) if policy.trials[index[method, length]] > 0 else float("nan")
        theirs = tokens[label] / wall[label] if wall[label] else float("nan")
        cells.append(f"{label} {mine:.0f} / {theirs:.0f}")
    leader = policy.arms[policy.last_leader].label if policy.last_leader is not None else "-"
    print(f"pass {number + 1} prompt {seed:2d}: policy / fixed row tokens/s: {', '.join(cells)}; leader {leader}; "
          f"ran {dict(arms)}")


def report(number: int, rows, calls, wall, tokens, catch_ups, policy: float, steps: float) -> None:
    """One pass's tables; ``policy``: seconds in auto's choose and flush, ``steps``: in AutoDecoder.step but its
    draft's deferred prompt feeds."""
    iteration = collections.Counter()
    for row, _, _, _, seconds, *_ in calls:
        iteration[row] += seconds
    print(f"### Pass {number + 1}\n")
    print("| row | tokens/s | wall | iterations | draft catch-ups | rest |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, _, _ in rows:
        rest = wall[label] - iteration[label] - catch_ups[label]
        print(f"| {label} | {tokens[label] / wall[label]:.0f} | {wall[label] * 1e3:.0f} | {iteration[label] * 1e3:.0f} | "
              f"{catch_ups[label] * 1e3:.0f} | {rest * 1e3:.0f} |")
    best = max((label for label, method, _ in rows if method != "auto"), key=lambda label: tokens[label] / wall[label])
    per_token = iteration[best] / tokens[best]  # the reference's iteration seconds per token
    rest_per_token = (wall[best] - iteration[best] - catch_ups[best]) / tokens[best]
    n = tokens["auto"]
    loss = wall["auto"] - n * wall[best] / tokens[best]
    parts = collections.defaultdict(lambda: [0, 0, 0.0])  # (why, switch-in) -> calls, tokens, excess seconds
    arms = collections.defaultdict(lambda: [0, 0.0, 0])
    previous = None  # (the arm of auto's iteration before, in the same generation)
    for row, prompt, arm, count, seconds, why in (call for call in calls if call[0] == "auto"):
        if previous is not None and previous[0] != prompt:
            previous = None
        part = parts[why, previous is None or arm != previous[1]]
        part[0] += 1
        part[1] += count
        part[2] += seconds - count * per_token
        arms[arm][0] += count
        arms[arm][1] += seconds
        arms[arm][2] += 1
        previous = (prompt, arm)
    print(f"\n`auto` / best fixed row ({best}): {wall[best] / tokens[best] / (wall['auto'] / n):.3f}; `auto`'s loss at "
          f"its {n} tokens: {loss * 1e3:.1f} ms ({loss / wall['auto'] * 100:.1f}% of its wall time), split as\n")
    print("| iterations | calls | tokens | excess over the best row's per token, ms |")
    print("|---|---:|---:|---:|")
    explained = 0.0
    for (why, switch), (count, made, excess) in sorted(parts.items(), key=lambda item: -item[1][2]):
        print(f"| {why}{', switch-in' if switch else ''} | {count} | {made} | {excess * 1e3:.1f} |")
        explained += excess
    rest = wall["auto"] - iteration["auto"] - catch_ups["auto"] - n * rest_per_token
    print(f"| draft catch-ups after `ar` | | | {catch_ups['auto'] * 1e3:.1f} |")
    print(f"| the rest (policy, `AutoDecoder`, loop) less the best row's | | | {rest * 1e3:.1f} |")
    own = steps - iteration["auto"] - catch_ups["auto"] - policy
    loop = wall["auto"] - steps  # (the generate loop's, outside AutoDecoder.step)
    print(f"| of which: the policy (choose, flush) | | | {policy * 1e3:.1f} |")
    print(f"| of which: `AutoDecoder.step`'s own | | | {own * 1e3:.1f} |")
    print(f"| of which: the loop, less the best row's rest | | | {(loop - n * rest_per_token) * 1e3:.1f} |")
    print(f"| sum (= the loss) | | | {(explained + catch_ups['auto'] + rest) * 1e3:.1f} |\n")
    print("| arm | in | iterations | tokens an iteration | ms an iteration | ms a token |")
    print("|---|---|---:|---:|---:|---:|")
    mine = sorted(arms.items(), key=lambda kv: -kv[1][0])
    theirs = collections.defaultdict(lambda: [0, 0.0, 0])  # the fixed rows' iterations, by arm
    for row, _, arm, count, seconds, *_ in calls:
        if row != "auto":
            entry = theirs[row, arm]
            entry[0] += count
            entry[1] += seconds
            entry[2] += 1
    for (row, arm), entry in sorted(theirs.items()):
        mine.append((f"{arm}", entry, row))
    for arm, (made, seconds, count), *row in mine:
        print(f"| {arm} | {row[0] if row else 'auto'} | {count} | {made / count:.2f} | {seconds / count * 1e3:.3f} | "
              f"{seconds / made * 1e3:.3f} |")
    print()


if __name__ == "__main__":
    main()
