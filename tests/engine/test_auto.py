"""``method="auto"``: lossless while it switches arms, and it settles on the fastest arm."""

from __future__ import annotations

import pytest

import gbv.engine.auto as auto
from gbv.engine.auto import Arm, AutoPolicy
from gbv.engine.generate import generate
from gbv.models.loading import ModelPair

from engine_toy import hf_pair, sharp_llama_pair, sharpen, table_pair
from test_exactness import check

# Short arms only: the law test generates 3 tokens, so longer blocks would never fit.
SHORT_ARMS = [Arm("ar", 0, 0), Arm("block", 1, 1), Arm("block", 1, 2), Arm("gbv", 2, 2), Arm("traversal", 3, 2)]


@pytest.fixture
def short_arms(monkeypatch):
    monkeypatch.setattr(auto, "default_arms", lambda greedy, has_draft: SHORT_ARMS)


@pytest.mark.parametrize("engine", ["tree", "hf"])
def test_auto_is_lossless(short_arms, engine, monkeypatch):
    # every arm must run (the switches are what is tested), even those too slow to ever win here
    monkeypatch.setattr(AutoPolicy, "ceiling", lambda self, index: float("inf"))
    pair = sharp_llama_pair() if engine == "tree" else ModelPair(*table_pair(vocab=6))
    target = pair.target
    stat, threshold = check(pair, 1200, 1.0, method="auto")
    assert stat < threshold, f"auto ({engine}): chi2 {stat:.1f} >= {threshold:.1f}"
    policy = next(iter(auto._POLICIES[target].values()))
    assert all(runs >= 2 for runs in policy.runs), "every arm should have run"


def test_auto_greedy_equals_target_greedy(short_arms):
    target, draft = hf_pair("llama", vocab=32, seed=7)
    sharpen(target, draft)
    pair = ModelPair(target, draft)
    reference = generate(pair, prompt_ids=[1, 2, 3], method="ar", temperature=0.0, max_new_tokens=30,
                         eos_token_id=[]).token_ids
    for seed in range(3):
        out = generate(pair, prompt_ids=[1, 2, 3], method="auto", temperature=0.0, max_new_tokens=30,
                       eos_token_id=[], seed=seed)
        assert out.token_ids == reference
        assert out.stats.method == "auto" and sum(out.stats.auto_arms.values()) > 0


def test_policy_explores_then_exploits_the_fastest_arm():
    arms = [Arm("ar", 0, 0), Arm("block", 1, 4), Arm("block", 1, 8)]
    speed = {0: 100.0, 1: 180.0, 2: 140.0}  # tokens per second of each arm
    policy = AutoPolicy(arms)
    chosen = []
    for _ in range(400):
        index = policy.choose()
        chosen.append(index)
        policy.record(index, 3, 3 / speed[index])
    assert all(runs >= 2 for runs in policy.runs)
    assert chosen[-100:].count(1) >= 90
    assert policy.best() == arms[1]
    # Near the end only short blocks fit: the cap is honoured.
    assert policy.arms[policy.choose(max_block=0)].method == "ar"


def test_arms_that_cannot_win_are_not_explored():
    """ar makes 700 tokens/s; a block of L costs 2 + 0.5 L ms, a multi-path arm 10 K L ms (a CPU, where
    trees are dear). The multi-path arm of K=2 L=4 runs once: even keeping every draft it would make
    62 tokens/s. The arms that dominate it (more paths or longer blocks) never run; the blocks are
    explored as before. When every arm gets 20x slower (another process takes the core), the stale
    ceiling of the multi-path arm is above the leader's rate again, and it is tried again."""
    arms = auto.default_arms(False, True)
    policy = AutoPolicy(arms)
    slow = [1.0]

    def run(index: int) -> None:
        arm = arms[index]
        if arm.method == "ar":
            policy.record(index, 1, slow[0] / 700)
        elif arm.num_paths == 1:
            policy.record(index, 2, slow[0] * (0.002 + 0.0005 * arm.block_len))
        else:
            policy.record(index, arm.block_len, slow[0] * 0.010 * arm.num_paths * arm.block_len)

    for _ in range(300):
        run(policy.choose())
    multi = [i for i, arm in enumerate(arms) if arm.num_paths > 1]
    assert policy.runs[multi[0]] == 1 and arms[multi[0]] == Arm(arms[multi[0]].method, 2, 4)
    assert all(policy.runs[i] == 0 for i in multi[1:])
    assert all(policy.runs[i] >= auto._MIN_TRIALS for i, arm in enumerate(arms) if arm.num_paths == 1)
    assert policy.best() == arms[0]
    slow[0] = 20.0
    for _ in range(1000):
        run(policy.choose())
    assert policy.runs[multi[0]] > 1


def test_policy_pools_acceptance_so_unlucky_first_trials_do_not_bury_a_long_block():
    """Every drafted token is kept with probability 0.9; a block of L costs 10 + 2 L ms. L = 8 is the
    fastest arm (6.1 tokens per 26 ms against 2.7 per 14 ms), but its first two trials are rejected
    at once. The acceptance learnt by L = 2 (pooled per verifier and K) still ranks L = 8 first; an
    arm judged by its own two trials alone (the policy before pooling) would never run it again."""
    import random

    arms = [Arm("ar", 0, 0), Arm("block", 1, 2), Arm("block", 1, 8)]
    policy = AutoPolicy(arms)
    draws = random.Random(0)
    chosen = []
    for _ in range(300):
        index = policy.choose()
        chosen.append(index)
        arm = arms[index]
        if arm.method == "ar":
            policy.record(index, 1, 0.008)
            continue
        accepted = 0
        unlucky = index == 2 and policy.runs[2] < 2
        while not unlucky and accepted < arm.block_len and draws.random() < 0.9:
            accepted += 1
        policy.record(index, accepted + 1, 0.010 + 0.002 * arm.block_len)
    assert chosen[-100:].count(2) >= 90
    assert policy.best() == arms[2]


def _burst_then_shift(policy: AutoPolicy) -> tuple[float, float, float]:
    """Expected tokens of BV L = 4 after 2,000 iterations keeping every drafted token, then 100 that keep
    none (a few hard prompts), then 4,000 that keep none (the workload changed)."""
    for _ in range(2000):
        policy.record(0, 5, 0.01)
    steady = policy.expected_tokens(0)
    for _ in range(100):
        policy.record(0, 1, 0.01)
    burst = policy.expected_tokens(0)
    for _ in range(4000):
        policy.record(0, 1, 0.01)
    return steady, burst, policy.expected_tokens(0)


def test_acceptance_follows_a_workload_not_a_few_prompts(monkeypatch):
    """A family's acceptance counts decay by ``_ACCEPTANCE_DECAY`` (0.999) per iteration: 100 hard
    iterations (three prompts) move the estimate of a block that kept everything for 2,000 by less than
    a third, and 4,000 more (a new workload) bring it near the new rate. The check can fail: with the
    decay of the costs (0.99), the same burst took the estimate down by more than half."""
    steady, burst, shifted = _burst_then_shift(AutoPolicy([auto.Arm("block", 1, 4)]))
    assert steady == pytest.approx(5.0, abs=0.01)
    assert burst > steady - (steady - 1.0) / 3
    assert shifted < 1.2
    monkeypatch.setattr(auto, "_ACCEPTANCE_DECAY", 0.99)
    steady, burst, _ = _burst_then_shift(AutoPolicy([auto.Arm("block", 1, 4)]))
    assert not burst > steady - (steady - 1.0) / 3


def test_one_early_rejection_does_not_zero_the_deeper_depths():
    """Two tries stopped at depth 3 (blocks of 8 accepting 2) must not make P(accepted >= 3) zero for
    the whole family: the rate at depth 3 is shrunk towards the rate above it (all accepted), so a block
    of 8 still expects more than the 3 tokens it made so far (a raw 0/2 rate gives exactly 3)."""
    arms = [auto.Arm("block", 1, 2), auto.Arm("block", 1, 8)]
    policy = auto.AutoPolicy(arms)
    for _ in range(2):
        policy.record(0, 3, 0.010)  # L = 2, whole block accepted
        policy.record(1, 3, 0.020)  # L = 8, accepted 2, rejected at depth 3
    assert policy.expected_tokens(1) > 4.0
    assert policy.expected_tokens(0) == pytest.approx(3.0, abs=0.01)


def _reference_ceiling(policy: AutoPolicy, index: int) -> float:
    """(L + 1) tokens over the least the arm can cost: its own mean seconds, or before it ran, the
    largest mean of the speculative arms with no more paths and no longer blocks."""
    arm = policy.arms[index]
    means = [policy.seconds[j] / policy.trials[j] for j, other in enumerate(policy.arms)
             if policy.trials[j] > 0 and (j == index or (policy.trials[index] == 0 and other.method != "ar"
                                                          and other.num_paths <= arm.num_paths
                                                          and other.block_len <= arm.block_len))]
    return (arm.block_len + 1) / max(means) if means else float("inf")


def _reference_choice(policy: AutoPolicy, max_block: int | None, context: float | None = None) -> int:
    """The UCB choice computed from scratch with :meth:`AutoPolicy.rate` (no cached rates), at ``context``."""
    import math

    def rate(i: int) -> float:  # an arm that did not run last pays its switching cost
        horizon = auto._HORIZON if max_block is None else min(auto._HORIZON, max_block + 1.0)
        return policy.rate(i, context) * (1.0 if i == policy.previous else policy.switch_factor(i, horizon, context))

    allowed = [i for i, arm in enumerate(policy.arms) if max_block is None or arm.block_len <= max_block]
    explored = [i for i in allowed if policy.runs[i] >= auto._MIN_TRIALS]
    if explored:  # speculative arms that cannot beat the best explored one even with every draft kept are left out
        leader = max(explored, key=rate)
        allowed = [i for i in allowed if i == leader or policy.arms[i].method == "ar"
                   or _reference_ceiling(policy, i) >= rate(leader)]
    for i in allowed:
        if policy.runs[i] < auto._MIN_TRIALS or (policy.arms[i].method == "ar" and policy.steady_trials[i] == 0
                                                 and policy.runs[i] < 2 * auto._MIN_TRIALS):
            return i
    rates = {i: rate(i) for i in allowed}
    best_rate = max(rates.values()) or 1.0
    total = sum(policy.aged_trials(i) for i in allowed)
    return max(allowed, key=lambda i: rates[i] + auto._BONUS * best_rate * math.sqrt(
        math.log(max(total, 2.0)) / max(policy.aged_trials(i), 1e-9)))


def _replay_choices(policy: AutoPolicy, seed: int, contexts: bool = True) -> list[tuple[int, int]]:
    """Random iterations (the policy's own choices, random yields and clocks that grow with the context,
    some capped blocks): the policy's choice and the from-scratch choice at every step (rated at each
    iteration's context, or, ``contexts=False``, at the arms' own)."""
    import random

    rng = random.Random(seed)
    pairs = []
    context = 40
    for _ in range(400):
        cap = rng.choice([None, None, None, 2, 4, 0])
        at = context if contexts else None
        chosen = policy.choose(cap, context=at)
        pairs.append((chosen, _reference_choice(policy, cap, at)))
        arm = policy.arms[chosen]
        tokens = rng.randint(1, arm.block_len + 1) if arm.block_len else 1
        seconds = rng.uniform(0.5, 1.5) * (0.005 + 0.002 * arm.num_paths * arm.block_len) * (1 + 0.004 * context)
        policy.record(chosen, tokens, seconds, context=at)
        context = context + tokens if context < 300 else 40  # (generations of ~260 tokens)
    return pairs


def test_cached_rates_give_the_choices_of_rates_computed_afresh():
    """choose() keeps each arm's rate until its family runs again; over random histories it picks
    exactly the arm that the rates computed from scratch pick, every time (with and without
    multi-path arms). The check can fail: rates kept across their family's runs pick other arms."""
    for greedy in (False, True):
        for seed in range(3):
            for contexts in (True, False):
                pairs = _replay_choices(AutoPolicy(auto.default_arms(greedy, True)), seed, contexts)
                assert all(mine == fresh for mine, fresh in pairs)
    for contexts in (True, False):
        stale = AutoPolicy(auto.default_arms(False, True))
        stale._members = {family: [] for family in stale._members}  # a family's runs leave its rates as they were
        pairs = _replay_choices(stale, 0, contexts)
        assert any(mine != fresh for mine, fresh in pairs)


def _held_run(policy: AutoPolicy, seed: int, deferred: bool) -> tuple[list[int], list]:
    """The decoder's pattern: a choice, then up to 8 iterations of the chosen arm without one, each
    recorded at once or deferred. Returns the choices and the policy's sums after a final flush."""
    import random

    rng = random.Random(seed)
    choices = []
    for _ in range(120):
        cap = rng.choice([None, None, 3, 0])
        chosen = policy.choose(cap)
        choices.append(chosen)
        arm = policy.arms[chosen]
        for _ in range(rng.randint(1, 8)):
            tokens = rng.randint(1, arm.block_len + 1) if arm.block_len else 1
            seconds = rng.uniform(0.5, 1.5) * (0.005 + 0.002 * arm.num_paths * arm.block_len)
            (policy.defer if deferred else policy.record)(chosen, tokens, seconds)
    policy.flush()
    return choices, [policy.runs, policy.trials, policy.seconds, policy.switch_sums, policy.stamps]


def test_deferred_records_give_the_choices_and_sums_of_records_applied_at_once(monkeypatch):
    """The decoder defers its records to the next choice (AutoPolicy.defer): every choice and every sum
    equals those of the same records applied at once, over random held runs. The check can fail: a
    policy that drops its deferred records chooses otherwise."""
    for seed in range(3):
        immediate = _held_run(AutoPolicy(auto.default_arms(False, True)), seed, deferred=False)
        assert _held_run(AutoPolicy(auto.default_arms(False, True)), seed, deferred=True) == immediate
    monkeypatch.setattr(AutoPolicy, "flush", lambda self: self._pending.clear())
    dropped = _held_run(AutoPolicy(auto.default_arms(False, True)), 0, deferred=True)
    assert dropped[0] != _held_run(AutoPolicy(auto.default_arms(False, True)), 0, deferred=False)[0]


def test_where_ar_leads_the_draft_is_fed_the_prompt_only_when_it_is_needed(monkeypatch):
    """With ar the leader, auto's prefill leaves the draft unfed (no draft forward at all while ar
    runs). When a speculative arm runs, the draft is first fed the prompt, outside the arm's clock,
    and its cache then gives the logits of a fresh prefill."""
    import time

    import torch

    from gbv.engine.decoder import make_decoder
    from gbv.engine.sampling import SamplingConfig

    target, draft = hf_pair("llama", vocab=32, seed=5)
    arms = [Arm("ar", 0, 0), Arm("block", 1, 3)]
    monkeypatch.setattr(auto, "default_arms", lambda greedy, has_draft: arms)
    sampling = SamplingConfig(temperature=1.0)
    dec = make_decoder(target, draft, "auto", 1, 3, 32, sampling, sampling, 0, "cpu")
    for _ in range(2 * auto._STRETCH):
        dec.policy.record(0, 1, 0.001)  # ar explored (two stretches): the leader; the block arm is still to explore
    prompt = [1, 2, 3, 4, 5, 6, 7]
    with torch.inference_mode():
        dec.prefill(prompt)
        assert dec.base.draft_len == 0  # nothing fed to the draft
        real = dec.base.catch_up_draft

        def slow_catch_up(*args):
            time.sleep(0.3)
            real(*args)

        monkeypatch.setattr(dec.base, "catch_up_draft", slow_catch_up)
        new = dec.step()
        dec.policy.flush()  # (the decoder defers its records to the next choice)
        assert dec.policy.runs[1] == 1 and dec.policy.seconds[1] < 0.3  # the catch-up is not the arm's
        tokens = dec.base.tokens
        assert tokens == prompt + new and dec.base.draft_len >= len(prompt) - 1
        cached = dec.base._chain(dec.base.draft, dec.base.draft_cache, tokens[dec.base.draft_len:],
                                 dec.base.draft_len)
        # (a fresh prefill through the view the engine drafts with: bfloat16-rounded weights on the CPU)
        fresh = dec.base._chain(dec.base.draft, dec.base.draft.plain_cache(1, len(tokens) + 8), tokens, 0)
    torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=0)


def test_the_drafts_unfed_prompt_is_charged_to_the_speculative_arms():
    """A speculative arm's first iteration of a generation feeds the draft the deferred prompt; choose() rates
    the speculative arms with that feed's measured seconds spread over the remaining tokens. BV at 1.05x ar's
    rate wins with the prompt fed, loses with 100 prompt tokens at 100 us each still to feed over 128 tokens
    (10 ms, 8% of ar's 128 ms), and wins again over a generation long enough to pay for it; an arm 1.3x ar
    wins over 128 tokens too. Nothing is charged before a feed has been measured."""
    arms = [Arm("ar", 0, 0), Arm("block", 1, 2)]

    def settled(block_rate: float) -> AutoPolicy:
        policy = AutoPolicy(arms)
        for _ in range(4):  # two stretches of ar after ar (settled), then blocks of 3 tokens
            for _ in range(auto._STRETCH):
                policy.record(0, 1, 0.001)
        for _ in range(40):
            policy.record(1, 3, 3 / (1000.0 * block_rate))
        policy.previous = None  # (a prefill: every arm a switch-in)
        return policy

    policy = settled(1.05)
    assert policy.choose(127, unfed_prompt=100) == 1  # (no feed measured yet: no charge)
    policy.record_prompt_feed(100, 0.01)
    assert policy.choose(127, unfed_prompt=0) == 1
    assert policy.choose(127, unfed_prompt=100) == 0
    assert policy.choose(4095, unfed_prompt=100) == 1
    fast = settled(1.3)
    fast.record_prompt_feed(100, 0.01)
    assert fast.choose(127, unfed_prompt=100) == 1


def test_auto_defers_the_drafts_prompt_and_measures_its_feed():
    """Whichever arm leads, auto's prefill leaves the draft unfed; the first speculative iteration feeds it
    the prompt (outside the arm's clock) and records that feed's tokens and seconds in the policy."""
    import torch

    from gbv.engine.decoder import make_decoder
    from gbv.engine.sampling import SamplingConfig

    target, draft = hf_pair("llama", vocab=32, seed=5)
    arms = [Arm("ar", 0, 0), Arm("block", 1, 3)]
    sampling = SamplingConfig(temperature=1.0)
    import unittest.mock
    with unittest.mock.patch.object(auto, "default_arms", lambda greedy, has_draft: arms):
        dec = make_decoder(target, draft, "auto", 1, 3, 32, sampling, sampling, 0, "cpu")
    for _ in range(2):
        dec.policy.record(1, 4, 0.0001)  # the block arm explored and leading by far
    for _ in range(2 * auto._STRETCH):
        dec.policy.record(0, 1, 0.01)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    with torch.inference_mode():
        dec.prefill(prompt)
        assert dec.base.draft_len == 0 and dec.policy.feed_tokens == 0.0
        dec.step()
    assert dec.base.draft_len >= len(prompt) - 1
    assert dec.policy.feed_tokens == len(prompt) - 1 and dec.policy.feed_seconds > 0.0


@pytest.mark.parametrize("slow_feed", ["prompt", "generated tokens"])
def test_the_drafts_deferred_prompt_is_reported_as_prefill_time(slow_feed, monkeypatch):
    """The draft's prompt, fed at auto's first speculative iteration (here made to take 1 s), is counted in
    ``time_prefill``, as a fixed row's draft prefill is, and not in ``time_draft`` or ``time_total`` (what
    ``tokens_per_second`` is over). The contrast: the draft fed tokens that ``ar`` generated (the catch-up
    after a stretch of plain steps, made to take 1 s instead) is the generation's time."""
    import time as time_module

    import torch

    from gbv.engine import tree_decoder

    target, draft = hf_pair("llama", vocab=32, seed=5)
    pair = ModelPair(target, draft)
    arms = [Arm("ar", 0, 0), Arm("block", 1, 3)]  # (ar explores first: its stretch, then the block arm)
    monkeypatch.setattr(auto, "default_arms", lambda greedy, has_draft: arms)
    catch_up, chain, feeding, slept = tree_decoder.TreeDecoder.catch_up_draft, tree_decoder.TreeDecoder._chain, [], []

    def catch_up_draft(self, upto):  # (which feed this is: the prompt's, from slot 0, or generated tokens')
        feeding.append((self.draft_len == 0) == (slow_feed == "prompt"))
        try:
            catch_up(self, upto)
        finally:
            feeding.pop()

    def slow_chain_once(self, model, cache, ids, start, static=True):  # (the 1 s inside the feed's own work)
        if feeding and feeding[-1] and not slept and model is self.draft:
            slept.append(start)
            time_module.sleep(1.0)
        return chain(self, model, cache, ids, start, static)

    monkeypatch.setattr(tree_decoder.TreeDecoder, "catch_up_draft", catch_up_draft)
    monkeypatch.setattr(tree_decoder.TreeDecoder, "_chain", slow_chain_once)
    with torch.inference_mode():
        stats = generate(pair, prompt_ids=list(range(1, 12)), method="auto", temperature=1.0, max_new_tokens=60,
                         eos_token_id=[], seed=0).stats
    assert slept and stats.auto_arms.get("block K=1 L=3"), "the block arm should have run after ar's stretch"
    if slow_feed == "prompt":
        assert stats.time_prefill >= 1.0 and stats.time_draft < 1.0 and stats.time_total < 1.0
    else:
        assert stats.time_prefill < 1.0 and stats.time_total >= 1.0


class _CountingPolicy(AutoPolicy):
    def __init__(self, arms):
        super().__init__(arms)
        self.choices = 0

    def choose(self, max_block=None, unfed_prompt=0, context=None):
        self.choices += 1
        return super().choose(max_block, unfed_prompt, context)


class _FakeBase:
    """A decoder that commits every drafted token (and one more) at once, in no time."""

    def __init__(self):
        self.tokens, self.draft_len, self.stats = [0], 0, None

    def step(self, block_len):
        new = [1] * (block_len + 1)
        self.tokens += new
        return new


def test_the_leader_is_held_for_a_few_iterations_and_only_while_its_block_fits():
    """Once choose() picks the leader, the decoder runs it auto._HOLD iterations before choosing again
    (the choice's Python costs ~1% of a step from a cold cache); a cap its block does not fit ends
    the hold at once. Where no speculative block fits (a generation's last token or two), ar runs with
    no choice, and its switch-in step is not recorded (auto._TAIL_UNRECORDED)."""
    from gbv.engine.auto import _HOLD, AutoDecoder

    policy = _CountingPolicy([Arm("ar", 0, 0), Arm("block", 1, 2)])
    for _ in range(2 * auto._STRETCH):  # explored (two stretches of ar): the block arm leads by far
        policy.record(0, 1, 1.0)
    for _ in range(3):
        policy.record(1, 3, 1.0)
    base = _FakeBase()
    decoder = AutoDecoder(base, policy)
    decoder.prompt_len = 1
    for _ in range(4 * _HOLD):
        decoder.step()
    assert policy.choices == 4 and base.stats.auto_arms == {"block K=1 L=2": 4 * _HOLD}
    policy.flush()
    runs = list(policy.runs)
    decoder.step(1)  # only ar fits: run at once, although the hold had iterations left
    policy.flush()
    assert policy.choices == 4 and base.stats.auto_arms["ar"] == 1
    assert policy.runs == runs and policy._stretch is None  # (not recorded: no open stretch either)
    assert decoder.step(3) and policy.choices == 5  # (a block fits again: a choice)


def test_recording_and_first_uses_of_static_shapes_are_not_an_arms_cost():
    """Where forwards are CUDA graphs, an iteration's seconds spent recording graphs or running new
    shapes before their recording (static_steps.RECORD_AT) are once-per-process work: the arm is
    credited the rest. Without that, an arm's first trials, run eagerly at 2-6x their replayed cost on a
    GPU, could keep it under its ceiling for good."""
    import time

    from gbv.engine.auto import AutoDecoder
    from gbv.engine.static_steps import StaticSteps

    class Model:  # a lean view with static steps whose one-off work this fake step adds to
        def __init__(self):
            self.steps = StaticSteps(None, capture=False)

    class Base(_FakeBase):
        target, draft = Model(), Model()

        def step(self, block_len):
            time.sleep(0.03)  # 20 ms of it first uses, 9 ms recording: about 1 ms the arm's
            self.target.steps.first_use_seconds += 0.02
            self.draft.steps.capture_seconds += 0.009
            return super().step(block_len)

    policy = AutoPolicy([Arm("block", 1, 2)])
    decoder = AutoDecoder(Base(), policy)
    decoder.prompt_len = 1
    decoder.step()
    policy.flush()
    assert 0.0005 < policy.seconds[0] < 0.01


@pytest.mark.parametrize("clipped", [True, False])
def test_one_stalled_iteration_does_not_bury_the_leader(clipped, monkeypatch):
    """ar makes 1000 tokens/s, BV L = 2 about 830. One ar iteration stalls 50x (a garbage collection):
    counted at most 3x ar's mean, ar keeps the lead. The control counts it in full: ar's mean doubles,
    the block arm leads, and ar, whose estimate only changes when it runs, stays buried."""
    if not clipped:
        monkeypatch.setattr(auto, "_OUTLIER", float("inf"))
    arms = [Arm("ar", 0, 0), Arm("block", 1, 2)]
    policy = AutoPolicy(arms)
    turn = [0]

    def run(index: int, stall: float = 1.0) -> None:
        if index == 0:
            policy.record(0, 1, 0.001 * stall)
        else:
            turn[0] += 1
            policy.record(1, 2 + turn[0] % 2, 0.003)  # 2.5 tokens in 3 ms

    for _ in range(300):
        run(policy.choose())
    run(0, stall=50.0)
    chosen = []
    for _ in range(600):
        index = policy.choose()
        chosen.append(index)
        run(index)
    share = chosen.count(0) / len(chosen)
    assert share > 0.95 if clipped else share < 0.5


@pytest.mark.parametrize("aging", [True, False])
def test_an_arm_that_became_faster_is_found_again(aging, monkeypatch):
    """ar makes 1000 tokens/s, BV L = 2 about 890 (2.5 tokens in 2.8 ms) for 400 iterations; then the
    machine changes and BV L = 2 makes 1250 (2 ms). With the arms' trials aged (auto._AGE), BV L = 2's
    stale estimate loses its weight, UCB tries it again and the policy moves to it. The control
    (no aging) keeps to ar: BV's estimate only changes when it runs, and its bonus has shrunk."""
    if not aging:
        monkeypatch.setattr(auto, "_AGE", 1.0)
    policy = AutoPolicy([Arm("ar", 0, 0), Arm("block", 1, 2)])
    turn = [0]

    def run(index: int, block_seconds: float) -> None:
        if index == 0:
            policy.record(0, 1, 0.001)
        else:
            turn[0] += 1
            policy.record(1, 2 + turn[0] % 2, block_seconds)

    first = []
    for _ in range(400):
        first.append(policy.choose())
        run(first[-1], 0.0028)
    assert first.count(0) > 300  # ar led
    chosen = []
    for _ in range(3000):
        index = policy.choose()
        chosen.append(index)
        run(index, 0.002)
    share = chosen[-1000:].count(1) / 1000
    assert share > 0.95 if aging else share < 0.05


class _TimedBase:
    """A decoder whose iterations take given times on a fake clock (``auto.time`` is patched to read
    it): ``ar_ms(run)`` and ``block_ms(run, blocks)`` give the milliseconds of a step that follows
    ``run`` steps of its own kind (0: after the other kind or a prefill), ``blocks`` being the block
    iterations so far; a BV iteration commits 2 or 3 tokens."""

    def __init__(self, clock, ar_ms, block_ms):
        import random

        self.clock, self.ar_ms, self.block_ms, self.rng = clock, ar_ms, block_ms, random.Random(0)
        self.tokens, self.draft_len, self.stats = [0], 10**9, None
        self.last, self.run, self.blocks = None, 0, 0

    def prefill(self, prompt_ids):
        self.tokens, self.last = list(prompt_ids), None

    def step(self, block_len):
        kind = "block" if block_len else "ar"
        self.run = self.run + 1 if kind == self.last else 0
        self.last = kind
        if kind == "ar":
            self.clock[0] += 1e-3 * self.ar_ms(self.run)
            new = [1]
        else:
            self.blocks += 1
            self.clock[0] += 1e-3 * self.block_ms(self.run, self.blocks)
            new = [1] * self.rng.choice((2, 3))
        self.tokens += new
        return new


def _ar_share(monkeypatch, ar_ms, block_ms, prompts: int = 100) -> float:
    """Prompts of 128 tokens through AutoDecoder over ar and BV L = 2 on a fake clock (_TimedBase): the
    share of ar among the iterations of the second half of the prompts."""
    import types

    from gbv.engine.auto import AutoDecoder

    clock = [0.0]
    monkeypatch.setattr(auto, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    policy = AutoPolicy([Arm("ar", 0, 0), Arm("block", 1, 2)])
    base = _TimedBase(clock, ar_ms, block_ms)
    runs = {"ar": 0, "block K=1 L=2": 0}
    for prompt in range(prompts):
        decoder = AutoDecoder(base, policy)
        decoder.prefill([0])
        while len(base.tokens) < 129:
            room = 129 - len(base.tokens) - 1
            decoder.step(room if room < 2 else None)
        if prompt >= prompts // 2:
            for label, count in base.stats.auto_arms.items():
                runs[label] += count
    return runs["ar"] / sum(runs.values())


_SETTLING_AR_MS = (1.0, 0.95, 0.94, 0.92, 0.85, 0.72, 0.70, 0.65)


@pytest.mark.parametrize("variant", ["rule", "one-step stretches", "costs over 8 tokens", "all stretches, no costs"])
def test_an_arm_whose_cost_settles_over_several_steps_is_tried_and_rated_in_stretches(variant, monkeypatch):
    """An ar step costs 1.0 ms right after another arm or a prefill and settles over 8 steps to 0.6 ms
    (1,667 tokens/s: the target's weights winning the L3 back, docs/ENGINE.md); BV L = 2 makes 2.5
    tokens in 1.7 ms (1,471 tokens/s), 1.9 ms after a switch. Over 128-token prompts ar is ~10% faster,
    its warm-up included. Run and recorded in stretches (auto._STRETCH), ar is measured at its settled
    cost (AutoPolicy.ar_seconds) and its warm-up as a switching cost, spread over the generation's next
    tokens (auto._HORIZON), and auto runs it. Controls: stretches of one step (the rule before) only
    ever see ar's first, slowest steps; a switching cost spread over 8 tokens (about the hold it was
    spread over before) costs ar ~20% of its rate at every prompt's start; ar's mean over all its
    stretches without switching costs holds its warm-up (either one alone is enough here; on the
    bundled pair the last step or two of a prompt, where only ar fits, also run right after BV).
    Each way BV keeps the lead."""
    if variant == "one-step stretches":
        monkeypatch.setattr(auto, "_STRETCH", 1)
    if variant == "costs over 8 tokens":
        monkeypatch.setattr(auto, "_HORIZON", 8.0)
    if variant == "all stretches, no costs":
        # (one stretch a switch-in, as before auto._SWITCH_IN_STRETCHES: with two, half of ar's stretches are
        # settled, and its mean over all of them is near enough its settled cost here)
        monkeypatch.setattr(auto, "_SWITCH_IN_STRETCHES", 1)
        monkeypatch.setattr(AutoPolicy, "switch_cost", lambda self, index: 0.0)
        monkeypatch.setattr(AutoPolicy, "ar_seconds", lambda self, index: self.seconds[index] / self.trials[index])
    share = _ar_share(monkeypatch, lambda run: _SETTLING_AR_MS[run] if run < len(_SETTLING_AR_MS) else 0.6,
                      lambda run, blocks: 1.7 if run else 1.9, prompts=60)
    assert share > 0.9 if variant == "rule" else share < 0.3


@pytest.mark.parametrize("variant", ["rule", "one stretch a switch-in", "tail steps recorded"])
def test_ar_measured_slow_at_the_start_is_measured_again_and_takes_over(variant, monkeypatch):
    """ar's steps settle at 0.75 ms in its first 64 steps (a process's first prompts: a cold machine), at
    0.6 ms after (1,667 tokens/s); BV L = 2 makes 2.5 tokens in 1.7 ms (1,471 tokens/s) throughout. After
    the first exploration BV leads (ar at 1,333 tokens/s). Under the rule UCB tries ar again as two stretches
    (auto._SWITCH_IN_STRETCHES), the second settled, ar's seconds follow to 0.6 ms, and ar runs nearly every
    iteration of the second half. Controls, each enough to keep BV in the lead: one stretch a switch-in (only
    ar's warm-up is measured again, and its settled seconds stay the first prompts'); recording the
    generations' last steps, which only ar fits (each record keeps ar's trials from aging, so UCB never tries
    it again: auto._TAIL_UNRECORDED)."""
    if variant == "one stretch a switch-in":
        monkeypatch.setattr(auto, "_SWITCH_IN_STRETCHES", 1)
    if variant == "tail steps recorded":
        monkeypatch.setattr(auto, "_TAIL_UNRECORDED", False)
    steps = [0]

    def ar_ms(run: int) -> float:
        steps[0] += 1
        settled = 0.75 if steps[0] <= 64 else 0.6
        return max(_SETTLING_AR_MS[run], settled) if run < len(_SETTLING_AR_MS) else settled

    share = _ar_share(monkeypatch, ar_ms, lambda run, blocks: 1.7 if run else 1.9)
    assert share > 0.9 if variant == "rule" else share < 0.1


@pytest.mark.parametrize("rated_at_the_context", [True, False])
def test_arms_whose_costs_cross_as_the_context_grows_each_run_where_they_are_faster(rated_at_the_context,
                                                                                    monkeypatch):
    """An ar step costs 0.3 + 0.002 c ms at a context of c tokens, a BV L = 2 iteration 1.2 + 0.002 c ms for 2.5
    tokens (attention reads every cached position; on the bundled pair the arms' slopes differ: docs/ENGINE.md,
    "Costs that grow with the context"). Per token ar is faster below c = 150, BV above. Prompts of 50 tokens
    and 200 new ones: rated at each iteration's context (auto._PRIOR_CONTEXT), auto runs ar for most of the
    iterations below 120 tokens and BV for most above 180, and takes less time than either arm alone. The
    control rates every arm at the contexts where it ran (the rule before): one arm runs on both sides."""
    import types

    from gbv.engine.auto import AutoDecoder

    if not rated_at_the_context:
        choose = AutoPolicy.choose
        monkeypatch.setattr(AutoPolicy, "choose", lambda self, max_block=None, unfed_prompt=0, context=None:
                            choose(self, max_block, unfed_prompt))
    clock = [0.0]
    monkeypatch.setattr(auto, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    holder = []
    base = _TimedBase(clock, lambda run: 0.3 + 0.002 * len(holder[0].tokens),
                      lambda run, blocks: 1.2 + 0.002 * len(holder[0].tokens))
    holder.append(base)
    policy = AutoPolicy([Arm("ar", 0, 0), Arm("block", 1, 2)])
    kinds = {"short": [], "long": []}
    step = base.step

    def logged(block_len):
        context = len(base.tokens)
        if prompt >= 30 and (context < 120 or context > 180):
            kinds["short" if context < 120 else "long"].append("block" if block_len else "ar")
        return step(block_len)

    base.step = logged
    start = 0.0
    for prompt in range(60):
        if prompt == 30:
            start = clock[0]
        decoder = AutoDecoder(base, policy)
        decoder.prefill([0] * 50)
        while len(base.tokens) < 251:
            room = 251 - len(base.tokens) - 1
            decoder.step(room if room < 2 else None)
    auto_ms = (clock[0] - start) * 1e3 / 30
    # each arm alone, per prompt (BV's 2.5 tokens an iteration on average)
    ar_ms = sum(0.3 + 0.002 * c for c in range(50, 250))
    block_ms = sum((1.2 + 0.002 * c) / 2.5 for c in range(50, 250))
    ar_short = kinds["short"].count("ar") / len(kinds["short"])
    block_long = kinds["long"].count("block") / len(kinds["long"])
    if rated_at_the_context:
        assert ar_short > 0.8 and block_long > 0.8, (ar_short, block_long)
        assert auto_ms < min(ar_ms, block_ms), (auto_ms, ar_ms, block_ms)
    else:
        assert ar_short < 0.5 or block_long < 0.5, (ar_short, block_long)


def test_ar_takes_over_from_an_arm_that_led_while_ar_ran_only_at_the_ends_of_prompts(monkeypatch):
    """ar makes 1000 tokens/s in a run of its own steps, but a step after another arm or a prefill
    costs 1.15 ms; BV L = 2 makes 2 or 3 tokens (2.5 on average) in 2.6 ms (962 tokens/s; 2.7 ms
    after another arm) and leads at first (its first 30 iterations are fast). While BV leads, ar runs
    only where a block no longer fits, in the last step or two of a prompt, right after BV. Those
    steps do not bury ar (in the nineteenth session they made it look ~15% slower than it ran, and BV
    kept the lead: auto at 0.89x ar): auto moves to ar once BV slows down."""
    share = _ar_share(monkeypatch, lambda run: 1.0 if run else 1.15,
                      lambda run, blocks: (1.5 if blocks <= 30 else 2.6) + (0.0 if run else 0.1))
    assert share > 0.9


def test_a_batch_step_is_one_iteration_of_its_arm_with_every_rows_acceptance():
    """``record_rows``: a step of 16 rows advances the clock, the arm's trials and ar's stretch by one
    iteration at the rows' mean tokens and per-row seconds, and the family's acceptance by every row.
    Negative control: a record per row (the rule before) ran the clock 16 iterations a step."""
    arms = [Arm("ar", 0, 0), Arm("block", 1, 4)]
    batch, per_row = AutoPolicy(arms), AutoPolicy(arms)
    tokens = [1, 2, 5, 3] * 4
    batch.record_rows(1, tokens, 0.016)
    for row_tokens in tokens:
        per_row.record(1, row_tokens, 0.001)
    assert batch.clock == 1 and batch.trials[1] == 1.0 and per_row.clock == 16
    assert batch.tokens[1] == pytest.approx(sum(tokens) / 16) and batch.seconds[1] == pytest.approx(0.001)
    family_batch, family_rows = batch.acceptance[("block", 1)], per_row.acceptance[("block", 1)]
    assert family_batch.tried == pytest.approx(family_rows.tried)
    assert family_batch.kept == pytest.approx(family_rows.kept)
    assert batch.expected_tokens(1) == pytest.approx(per_row.expected_tokens(1))
    for _ in range(auto._STRETCH):  # ar: a stretch of _STRETCH batch steps, not of _STRETCH rows
        batch.record_rows(0, [1] * 16, 0.016)
        assert (batch.runs[0] == 1) == (_ == auto._STRETCH - 1)
    assert batch.ar_seconds(0) == pytest.approx(0.001)


def test_the_auto_rows_of_a_batch_run_one_arm_a_step(monkeypatch):
    """Every ``auto`` row of a batch with the same settings runs the same arm in each step (the step's
    seconds measure that arm only then), the arms still change between steps, and a row whose cap cuts
    the arm's block (near its end) is not recorded as the arm's iteration."""
    from gbv.engine.generate import BatchRows

    pair = sharp_llama_pair()
    steps = []
    real = BatchRows._choose_arms

    def choose(self, rows_steps, context=None):
        chosen = real(self, rows_steps, context)
        caps = {id(row): step.block for row, step in rows_steps}
        steps.append([(id(policy), index, whole, caps[id(row)] >= policy.arms[index].block_len)
                      for row, policy, index, whole in chosen])
        return chosen

    monkeypatch.setattr(BatchRows, "_choose_arms", choose)
    outs = generate(pair, prompt_ids=[[1, 2], [3], [4, 4, 1, 0], [2, 2, 2]], batch_size=4, method="auto",
                    temperature=1.0, max_new_tokens=80, eos_token_id=[], seed=1)
    assert all(len({(policy, index) for policy, index, _, _ in step}) == 1 for step in steps)
    # (ar explores first, then the speculative arms in order; which of them get tried after the first
    # depends on measured times, so only "more than one arm" is certain)
    assert len({index for step in steps for _, index, _, _ in step}) > 1
    assert all(whole == fits for step in steps for _, _, whole, fits in step)
    assert all(sum(o.stats.auto_arms.values()) > 0 for o in outs)


def test_a_batch_row_keeps_the_policy_of_its_batch_size(monkeypatch):
    """The auto rows of a batch look their policy up once per batch size (cached on the row): as the
    batch shrinks from 4 rows to 2 and to 1, each step still uses the policy that ``policy_for`` gives
    for the current size bucket (the single-sequence one at 1 row)."""
    from gbv.engine.batch import BatchTreeDecoder
    from gbv.engine.generate import BatchRows, prepare_job

    pair = sharp_llama_pair()
    seen = []
    real = BatchRows._choose_arms

    def choose(self, rows_steps, context=None):
        chosen = real(self, rows_steps, context)
        bucket = 1 << (len(rows_steps) - 1).bit_length()
        for row, policy, _, _ in chosen:
            arms, key = row.auto
            expected = auto.policy_for(pair.target, pair.draft, key if bucket == 1 else (*key, bucket), arms)
            seen.append((bucket, policy is expected))
        return chosen

    monkeypatch.setattr(BatchRows, "_choose_arms", choose)
    jobs = [prepare_job(pair, ids, method="auto", temperature=1.0, max_new_tokens=new, eos_token_id=[], seed=i)
            for i, (ids, new) in enumerate([([1, 2], 6), ([3], 6), ([4, 4, 1], 20), ([2, 2], 40)])]
    rows = BatchRows(pair, BatchTreeDecoder(pair.target, pair.draft, jobs[0].vocab, pair.device, 4))
    for i, job in enumerate(jobs):
        rows.add(i, job, emit=False)
    while rows.active:
        rows.step()
    assert {bucket for bucket, _ in seen} == {1, 2, 4}
    assert all(same for _, same in seen)


def test_each_engine_learns_its_own_policy(monkeypatch):
    """``auto`` on the plain Hugging Face path (GBV_ENGINE=hf) and on the tree engine, one pair in one
    process: two policies, since the engines' costs differ (one shared policy would price the tree
    engine's arms with the other's times)."""
    target, draft = hf_pair("llama", vocab=32, seed=11)
    pair = ModelPair(target, draft)
    settings = dict(method="auto", max_new_tokens=6, eos_token_id=[], seed=0)
    monkeypatch.setenv("GBV_ENGINE", "hf")
    generate(pair, prompt_ids=[1, 2, 3], **settings)
    monkeypatch.delenv("GBV_ENGINE")
    generate(pair, prompt_ids=[1, 2, 3], **settings)
    keys = [key for _, key, _ in auto._POLICIES[target]]
    assert len(keys) == 2 and sorted(key[-1] == "hf" for key in keys) == [False, True]
