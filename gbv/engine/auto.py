"""``method="auto"``: choose the verifier, K and L per iteration from what has been measured so far.

Each arm is one setting (``ar``, or a verifier with K paths of L tokens). After every iteration the
arm that ran is credited with the wall time it took (the step's own clock, read after the drafts
were read back, so it covers the device work too), and its verifier family (method, K) with how far
the drafts were accepted. An arm's estimated tokens per second is its expected tokens per iteration,
from the family's pooled per-depth acceptance, over its own seconds per iteration at the current
context length (a line fitted to its iterations: costs grow with the context). The next arm
is the one with the best estimate, plus an optimism bonus that shrinks as an arm is tried (UCB), so
that every arm is tried a few times and then the best one runs almost always. An iteration right
after another arm counts less that arm's switching cost, which the arms other than the last one pay
when choosing (``_SWITCH_PAIRS``).

The estimates live as long as the pair and the sampling settings (one :class:`AutoPolicy` per target,
draft, temperature, top-k and top-p; see :func:`policy_for`), so a process that serves many prompts
learns once. It re-learns when the machine changes speed: old observations decay, and the estimates of
arms that do not run age (their UCB bonus grows), so they are tried again (``_AGE``).

Lossless: an iteration is lossless for any (method, K, L), and each choice depends only on the past
(committed tokens are not even looked at: only counts and clocks), never on the drafts or coins of
the iteration it is made for. tests/engine/test_auto.py checks the law by chi-square.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from dataclasses import dataclass

from gbv.engine.config import AUTO
from gbv.engine.decoder import method_settings
from gbv.engine.static_steps import recording_seconds
from gbv.engine.stats import GenerationStats
from gbv.verify import METHODS
# Each observation's weight decays by this factor per later observation of the same arm: the
# estimates follow a machine whose speed changes (another process starts), over ~100 iterations.
_DECAY = 0.99
# The same for a family's acceptance counts (_Acceptance.record), per iteration of the family: its
# estimates follow the last ~1,000 iterations (~30 prompts of 128 tokens), not ~100. Why: at 0.99 the
# acceptance followed the text of the last few prompts, so the policy moved between block lengths with
# it (long blocks after easy stretches, short ones after hard ones), and an arm's rating mixed what it
# makes with where it happened to run: BV L = 3 made 2.85 tokens an iteration inside auto against 3.11
# alone (docs/ENGINE.md, "`auto` at the size"). On the bundled pair in float32 (40 prompts,
# eight runs of scripts/bench_auto_ab.py --before HEAD --blocks 3,4,6,8; docs/results/engine/
# auto-acceptance-decay-twentyninth.txt), 0.999 against 0.99: 0.952-1.050x (mean 0.994) at T = 0.2 and
# 0.984-1.049x (mean 1.029, 7 runs of 8 above 1) at T = 1; auto against the best BV length 0.936 and
# 0.971 on average, against 0.942 and 0.944. A change of workload (chat to code) still comes through,
# over ~1,000 iterations; costs keep _DECAY (the machine's speed drifts faster than the text).
_ACCEPTANCE_DECAY = 0.999
# Exploration: every arm runs this many times before the estimates are trusted.
_MIN_TRIALS = 2
_BONUS = 0.15
# Weight, in trials, of the family's fitted cost line in an arm's seconds per iteration.
_PRIOR_TRIALS = 5.0
# Weight, in iterations, of the rate of the depth above in a depth's acceptance rate. Without it one
# early rejection at depth d (1 of 2 tries) set P(accepted >= d) to 0 for every longer block of the
# family, and UCB's bonus was too small to try them again: in replays of measured traces (40 prompts,
# 12 arms) the worst runs fell to 0.69x the best arm, and to 0.88-0.91x with this prior.
_PRIOR_DEPTH_TRIALS = 4.0
# An observed iteration counts at most this many times its arm's mean seconds (once the arm has run
# _MIN_TRIALS times). Why: iteration times have a heavy right tail (a garbage collection, an interrupt,
# the other core's process). One 50 ms stall in a 2 ms ar step doubled ar's mean, handed the lead to a
# block arm at 0.84x ar's real rate, and since an arm's estimate only changes when it runs, ar stayed
# buried: auto at 0.87x ar over 40 prompts in bfloat16, a third of its iterations on block arms. A real
# slowdown still comes through, at up to 3x a mean per observation.
_OUTLIER = 3.0
# Every iteration of the policy (of any arm) ages every arm's sums by this factor, lazily: an arm that
# has not run for n iterations counts its trials as trials * _AGE^n, so its UCB bonus grows and it is
# tried again, and its old observations weigh less against the new ones (an arm's mean is not changed
# by aging alone). Why: an arm's estimate changed only when it ran, and the ratio of the arms' speeds
# drifts on a shared machine (BV L = 2 against ar in bfloat16 here: 0.82x in one hour, 1.03x in the
# next). In the seventeenth session's bf16 table, auto measured BV L = 2 in its first two prompts, then
# ran ar for 4,900 iterations at 0.97x ar while BV L = 2 ran at 1.03x. On synthetic arms
# (scripts/auto_replay.py drift: ar at 1,000 tokens/s, BV L = 2 at 890 that becomes 1,250) the policy
# moved to BV L = 2 about 150 iterations after the change; without aging, never (test_auto.py). The
# cost where nothing drifts: the arms near the leader are re-tried more often, 0.4-0.55% of the
# tokens/s with BV 3-14% behind ar, against 0.1% without aging. Replayed over recorded bf16 traces
# (auto_replay.py replay, 40 prompt orders), auto's worst run rose from 0.95x to 0.97x the best arm
# and its median stayed (1.03x / 1.00x at T = 0.2 / 1). Trials never age below _MIN_TRIALS: an arm is
# re-tried only while the bonus of an arm explored that often (0.15 sqrt(log(total) / 2) of the best
# rate, about 24%) could make up its gap. Without that floor, every multi-path arm of 0.6x the leader
# was re-tried every ~1,000 iterations at 10-40 ms a trial: auto lost 4% in float32 at T = 0.2 (one
# A/B run, scripts/bench_auto_ab.py). An arm left out by its ceiling (see choose) stays out too.
_AGE = 0.999
# An iteration that follows another arm (or a prefill) costs more than one that follows its own arm:
# on the bundled pair in bfloat16 an ar step took 1.54 ms (median) after another arm against 1.34 ms
# after an ar step, BV L = 2 3.6 against 3.5 ms, and more with the draft's catch-up after ar
# (scripts/auto_switch_cost.py, before this rule). Counted in full, an arm that runs only now and
# then looked slower than it runs: while a BV arm leads, ar runs only where a block no longer fits
# (the end of a prompt, right after BV; its ceiling keeps UCB from retrying it), so it looked ~15%
# slower, and BV arms up to 15% slower than ar kept the lead: auto at 0.89x ar in the nineteenth
# session's first bf16 table at T = 0.2, running BV L = 8 at 0.84x ar for the last 15 prompts. So each
# arm's seconds are its cost in a run of its own iterations: a switch-in iteration is counted less the
# arm's switching cost, estimated from pairs of a switch-in iteration and the next one of the same arm
# (measured at the same machine speed, so a drift of the machine's speed does not leak into it), and
# that cost, spread over the next tokens (_HORIZON), is added to the seconds of every arm but the one
# that just ran when choosing: the policy switches only for a gain that pays for the switch.
_SWITCH_PAIRS = 4.0  # weight, in pairs, of the prior "no switching cost" of an arm's switching cost
# The tokens a switching cost is spread over: the generation's remaining tokens, at most this many.
# Once the policy switches, the arm it switched to runs until another one is rated higher, and the
# others pay their switching costs: a switch is, in effect, for a good part of the generation. Spread
# over a hold (_HOLD iterations: 20 tokens of BV L = 2, 8 of ar) as before, ar's warm-up of ~1.5 ms
# (_STRETCH) cost it ~25% of its rate at every prompt's start, where every arm starts cold, and auto ran
# BV where ar was 10% faster: in the fake-clock test of tests/engine/test_auto.py ar ran 23% of the
# iterations with costs over 8 tokens, 64% over 16, 95% over 24, 99% over 32. On the bundled pair in
# bf16 (scripts/bench_auto_ab.py --switch horizon, after / before, T = 0.2 / 1): 64 tokens against 16,
# 0.967 / 0.963; 32 against 16, 0.991 / 1.028. Not the whole generation: it may end early (EOS).
_HORIZON = 32.0
# Once choose() picks the leader, the decoder runs it this many iterations before choosing again.
# Why: between forwards that stream tens of MB of weights, the policy's Python runs from a cold cache:
# a choice cost ~22 us and its record ~9 us in bfloat16 here, against a 2 ms ar step (1.5%). Holding
# delays an exploratory trial by at most 7 iterations; each choice still depends only on the past.
# The decoder also defers its records (AutoPolicy.defer) to the next choice, which applies them in
# order first: the same state at every choice, and the records of a hold run one after another, warm.
# (A record cost ~25 us in the engine, cold, against ~4 us warm; 76 us of policy work an iteration
# was 1.8% of a float32 BV iteration, ~3% of a bfloat16 one.)
_HOLD = 8
# ar runs in stretches of this many steps: a choice of ar (as the leader or as a trial) runs that many
# plain steps before the next choice, and the policy counts consecutive ar steps, up to a stretch, as one
# record for its switching cost (the pairs of _SWITCH_PAIRS; per step, ar's sums are as before). ar's
# seconds a step are those of its settled stretches, the ones that follow a stretch of ar
# (AutoPolicy.ar_seconds), and ar explores until it has one (or has run 2 * _MIN_TRIALS stretches). ar
# also has no ceiling (see choose), and the draft's catch-up after ar is timed apart (AutoDecoder.step).
# Why: right after another arm or a prefill an ar step takes about eight steps to settle, where a
# speculative iteration settles after one (on the bundled pair in bfloat16: 0.82, 0.79, 0.75, 0.73, 0.67,
# 0.63, 0.60, 0.57, then 0.55-0.58 ms, while BV L = 2 went 2.19, then 1.45-1.54 ms;
# scripts/auto_warmup.py). Not from clock speed: a product that stays in the L2 runs at its full rate
# after any pause, while the target's 1-row products over its 15.7 MB take ~10 calls to come back to speed
# after a 5 ms pause, a sleep, or a pass of many rows (docs/ENGINE.md, "`auto`: ar in stretches"). Tried
# one step at a time, ar only ever measured its first, slowest steps, and its switching cost, estimated
# from a switch-in step and the next one, was 0.05 ms instead of ~1.5: auto rated ar at 1,298 tokens/s
# where it ran at ~2,000, and ran BV at 0.86-0.91x ar (bench_auto_vs_block.py, bf16, T = 0.2). ``_STRETCH
# = 1`` is the rule before (scripts/bench_auto_ab.py --switch stretch).
_STRETCH = 16
# An ar choice that follows another arm or a prefill (a switch-in) runs this many stretches: the first
# with ar's warm-up, the others settled, which alone update ar's seconds a step (ar_seconds) and, paired
# with the first, its switching cost. Why: with one stretch, once a speculative arm led, ar ran only as
# switch-ins (UCB's trials, the last steps of a generation), so its settled seconds were those of its first
# exploration, at the process's start, and never changed. On the slower Zen 3 machine in bfloat16 auto
# rated ar at 0.73-0.77 ms a step, measured in its first two prompts, while the fixed ar row ran at 0.64
# (its settled stretches were all from the first prompts; later it ran only a step or two at the ends of
# generations: see _TAIL_UNRECORDED), and a switch-in stretch right after its first one measured no
# switching cost. With both rules the policy's ar seconds erred by -9% to +13% against the fixed row's in four
# runs (scripts/auto_clock_vs_rows.py bfloat16 0.2 10; docs/ENGINE.md, "`ar` measured again"): the error moves
# both ways on that machine, but no longer stays. A change of auto's speed over 40-80 prompts could not be
# resolved there: after / before both rules 0.962-1.059, mean 0.991, in ten paired runs
# (scripts/bench_auto_ab.py --before, bf16, T = 0.2 and 1).
_SWITCH_IN_STRETCHES = 2
# Where a generation's remaining tokens leave no room for any speculative block (its last one or two), ar runs
# them; after another arm, those steps are not recorded. Why: they are switch-ins of a step or two, all warm-up,
# at every generation's end while a speculative arm leads, and each record reset ar's aging (its trials stayed
# high), so UCB never tried ar again and its settled seconds stayed those of the process's first prompts: in the
# fake-clock test of tests/engine/test_auto.py ar ran 165 steps in 100 prompts while it had become 13% faster
# than BV (with this rule and _SWITCH_IN_STRETCHES, 8,500 and ar ran 97% of the second half's iterations).
_TAIL_UNRECORDED = True
# An arm's seconds an iteration are a line in the context length (the committed tokens, prompt included), fitted to
# its iterations (decayed and aged as its seconds are: AutoPolicy.context_line), and choose() rates every arm at the
# context of the iteration it chooses for. Why: attention reads every cached position, so an iteration's cost grows
# with the context, by amounts that differ between arms and move with the machine's state. On the bundled pair in
# bfloat16 (scripts/auto_context_cost.py; docs/results/engine/auto-context-cost-fiftieth.txt) an ar step cost 19%
# more at 250 tokens than at 100 and a BV iteration 5-7% more; in a first run of the measurement ar 35% and BV
# L = 2 21%, so that which of them made more tokens per second changed near 180 tokens, inside the benchmark's
# generations. Rated by plain means, arms were compared at the contexts where each happened to run: an arm tried
# again late in a generation was measured at that part's costs, against the leader's mean over whole generations.
# In paired runs (scripts/bench_auto_ab.py --before, 40 prompts, T = 0.2 and 1) auto made 0.963-1.060x its speed
# before, mean 1.008 in bfloat16 (12 values) and 1.013 in float32 (6): a gain of about 1%, within a run's noise of
# ~3%. On a fake clock where ar's and BV's costs
# cross at 150 tokens auto runs each where it is faster, and beats both (tests/engine/test_auto.py). A line with
# little spread in its contexts is shrunk towards the slope of the pooled evidence, in proportion to the arm's
# cost (weight _PRIOR_CONTEXT, in trials times tokens squared: eight iterations 32 tokens from their mean): an
# arm tried twice at a generation's start is rated at longer contexts as the others grow there, not as flat.
_PRIOR_CONTEXT = 8.0 * 32.0 ** 2
# (the seconds at a context never fall below this share of the arm's mean, whatever a noisy slope says)
_CONTEXT_FLOOR = 0.25
# The pooled slope is computed again every this many iterations, not at each record: it moves slowly (it is
# only a prior), and a new one changes every arm's rate, which choose() keeps between records (_rates).
_CONTEXT_REFRESH = 64
# The draft's prompt is fed only when a speculative arm first runs in a generation (AutoDecoder.prefill
# defers it; catch_up_draft then feeds it as one chain, outside every arm's clock). choose() charges that
# feed to the speculative arms while it is still to be paid: its seconds (the measured seconds per prompt
# token, decayed by _FEED_DECAY a feed, times the tokens still unfed) spread over the generation's
# remaining tokens, as a switching cost is spread over _HORIZON. Why: it is paid once a generation, by
# whichever speculative arm runs first, and no arm's rate showed it. On the slower Zen 3 machine of the
# forty-eighth session, in bfloat16, ar and BV L = 2-3 were within 2-5% of each other and the feed cost
# 36-39 us a prompt token (3.4-5 ms a prompt of the table): over 32-token generations at T = 0.2 the
# charge took auto from 0.93x to 0.97x ar, the draft fed in 4-6 generations of 120 instead of 32-37
# (scripts/bench_auto_prompt_feed.py; docs/ENGINE.md, "The draft's prompt, charged").
_FEED_DECAY = 0.9


@dataclass(frozen=True)
class Arm:
    """One setting of an iteration. ``method`` is ``ar`` (then ``num_paths == block_len == 0``)."""

    method: str
    num_paths: int
    block_len: int

    @functools.cached_property  # (read every iteration, to count the arms in the stats)
    def label(self) -> str:
        return "ar" if self.method == "ar" else f"{self.method} K={self.num_paths} L={self.block_len}"


def default_arms(greedy_draft: bool, has_draft: bool) -> list[Arm]:
    """ar, BV at L = 2..8, and a multi-path verifier at K = 2..4 (when the draft samples)."""
    arms = [Arm("ar", 0, 0)]
    if not has_draft:
        return arms
    arms += [Arm("block", 1, length) for length in (2, 3, 4, 6, 8)]
    if not greedy_draft:
        multi = "gbv-adaptive" if "gbv-adaptive" in METHODS else "traversal"
        arms += [Arm(multi, k, length) for k in (2, 3, 4) for length in (4, 8)]
    return arms


class AutoPolicy:
    """Estimated tokens per second of each arm, and the UCB choice among them.

    An arm's rate is (expected tokens per iteration) / (mean seconds per iteration). The seconds are
    the arm's own (they vary little between iterations). The tokens are not: one iteration commits
    between 1 and L + 1 of them, so a few unlucky trials could bury a long block for good. They are
    therefore estimated from acceptance statistics pooled over every arm of the same verifier and K
    (:class:`_Acceptance`): whether a drafted token at depth ``d`` is kept is measured by every arm
    with ``L >= d``, so a block of 8 learns from the blocks of 3 and 4 and vice versa.
    """

    def __init__(self, arms: list[Arm]) -> None:
        self.arms = list(arms)
        self.tokens = [0.0] * len(arms)  # decayed sums, for the table and arms without a family
        self.seconds = [0.0] * len(arms)
        self.trials = [0.0] * len(arms)  # decayed counts
        self.runs = [0] * len(arms)  # plain counts (of ar: its stretches)
        self.acceptance: dict[tuple[str, int], _Acceptance] = {}
        self._lines: dict[tuple[str, int], tuple[float, float] | None] = {}  # cost lines, per family
        # rate(i) of each arm until an iteration of its family (or of itself, for ar) changes it: a
        # choice then costs one rate instead of twelve (~120 -> ~20 us, 2% of an ar iteration here)
        self._rates: dict[int, float] = {}
        self._members: dict[tuple[str, int], list[int]] = {}  # family -> its arms' indices
        self._ceilings: dict[int, float] = {}  # ceiling(i), kept until an iteration changes what it depends on
        self._fitting: dict[int | None, tuple[int, ...]] = {}  # max_block -> the arms whose blocks fit
        self.last_leader: int | None = None  # the leader when choose() last ran (AutoDecoder holds it)
        self._pending: list[tuple[int, int, float, float]] = []  # deferred records, oldest first (defer)
        self.clock = 0  # iterations recorded, of every arm
        self.stamps = [0] * len(arms)  # the clock when each arm's sums were last aged
        # Switching costs (see _SWITCH_PAIRS): decayed sums of (switch-in seconds - next seconds) over
        # pairs, per arm; the arm that ran last (None after a prefill: the next iteration is a switch-in);
        # the switch-in iteration waiting for its pair; each arm's rate factor when it is not the last
        # one, 1 / (1 + cost * rate / horizon).
        self.switch_sums = [0.0] * len(arms)
        self.switch_pairs = [0.0] * len(arms)
        self.previous: int | None = None
        self._switch_in: tuple[int, float, int] | None = None  # (arm, seconds, steps)
        self._switch_costs = [0.0] * len(arms)  # switch_cost(i), kept until arm i runs again
        self.steady_seconds = [0.0] * len(arms)  # ar's decayed sums over its settled stretches (ar_seconds)
        self.steady_trials = [0.0] * len(arms)
        # The contexts of the iterations (see _PRIOR_CONTEXT), decayed and aged as the seconds: sums of
        # trials * context, trials * context^2 and seconds * context, over all of an arm's iterations and
        # (steady_*) over ar's settled stretches.
        self.contexts = [0.0] * len(arms)
        self.context_squares = [0.0] * len(arms)
        self.context_seconds = [0.0] * len(arms)
        self.steady_contexts = [0.0] * len(arms)
        self.steady_context_squares = [0.0] * len(arms)
        self.steady_context_seconds = [0.0] * len(arms)
        self._context_scale: float | None = None  # the pooled slope per second of cost (_CONTEXT_REFRESH)
        self._context_refresh = 0  # the clock at which it is computed again
        self._context_sums = tuple(getattr(self, name) for name in _CONTEXT_LISTS)  # (aged together)
        # ar's consecutive steps not yet recorded, [arm, steps, seconds, the arm that ran before them]
        # (see _STRETCH; ``previous`` is already ar).
        self._stretch: list | None = None
        # the draft's deferred prompt feeds (see _FEED_DECAY): decayed sums of their seconds and tokens
        self.feed_seconds, self.feed_tokens = 0.0, 0.0
        self._speculative = [arm.method != "ar" for arm in arms]
        for index, arm in enumerate(self.arms):
            if arm.method != "ar":
                family = self.acceptance.setdefault((arm.method, arm.num_paths), _Acceptance())
                family.grow(arm.block_len)
                self._members.setdefault((arm.method, arm.num_paths), []).append(index)

    def expected_tokens(self, index: int) -> float:
        """Tokens per iteration: 1 for ``ar``; else ``1 + sum_d P(accepted >= d)`` from the pooled
        acceptance of the arm's family (the arm's own mean before the family has any observation)."""
        arm = self.arms[index]
        if arm.method == "ar":
            return 1.0
        expected = self.acceptance[(arm.method, arm.num_paths)].expected_tokens(arm.block_len)
        if expected is None:
            return self.tokens[index] / self.trials[index] if self.trials[index] > 0 else 0.0
        return expected

    def mean_seconds(self, index: int) -> float:
        """Seconds per iteration: the arm's own mean, shrunk towards the line ``a + b L`` fitted to the
        means of its family (one draft forward per depth, a target pass that grows with the nodes),
        so that two slow first trials (a cold cache, a busy moment) do not bury an arm for good."""
        arm = self.arms[index]
        if arm.method == "ar":
            return self.ar_seconds(index)
        own = self.seconds[index] / self.trials[index]
        line = self._cost_line(arm.method, arm.num_paths)
        if line is None:
            return own
        fitted = line[0] + line[1] * arm.block_len
        if fitted <= 0.0:
            return own
        return (self.trials[index] * own + _PRIOR_TRIALS * fitted) / (self.trials[index] + _PRIOR_TRIALS)

    def ar_seconds(self, index: int) -> float:
        """ar's seconds a step: its mean over the stretches that followed a stretch of ar (settled, see
        ``_STRETCH``) once it has any, else over all its stretches (a switch-in counted less the
        switching cost)."""
        if self.steady_trials[index] > 0.0:
            return self.steady_seconds[index] / self.steady_trials[index]
        return self.seconds[index] / self.trials[index]

    def _cost_line(self, method: str, num_paths: int) -> tuple[float, float] | None:
        """``(a, b)`` of the weighted least-squares line ``seconds = a + b L`` over the tried arms of a
        family (None with fewer than two block lengths). Cached until the next :meth:`record`."""
        family = (method, num_paths)
        if family not in self._lines:  # (dropped by record when the family runs)
            points = [(a.block_len, self.seconds[i] / self.trials[i], self.trials[i]) for i, a in enumerate(self.arms)
                      if (a.method, a.num_paths) == family and self.trials[i] > 0]
            weight = sum(w for _, _, w in points)
            mean_l = sum(w * length for length, _, w in points) / weight
            spread = sum(w * (length - mean_l) ** 2 for length, _, w in points)
            line = None
            if spread > 0.0:
                mean_s = sum(w * sec for _, sec, w in points) / weight
                slope = sum(w * (length - mean_l) * (sec - mean_s) for length, sec, w in points) / spread
                line = (mean_s - slope * mean_l, slope)
            self._lines[family] = line
        return self._lines[family]

    def aged_trials(self, index: int) -> float:
        """The arm's trials as its UCB bonus counts them now: aged by ``_AGE`` per iteration since its
        sums were last aged (when it last ran), but not below ``_MIN_TRIALS`` (see ``_AGE``)."""
        return _aged(self.trials[index], self.clock - self.stamps[index])

    def rate(self, index: int, context: float | None = None) -> float:
        """Tokens per second at ``context`` committed tokens (None: at the contexts where the arm ran),
        computed afresh (choose() keeps the terms between records: _terms)."""
        tokens, seconds, slope, center = self.terms(index)
        if context is not None:
            seconds = max(seconds + slope * (context - center), _CONTEXT_FLOOR * seconds)
        return tokens / seconds

    def terms(self, index: int) -> tuple[float, float, float, float]:
        """``(tokens, seconds, slope, center)``: expected tokens per iteration, mean seconds per iteration
        at the mean context ``center``, and the seconds' slope in the context (:meth:`context_line`);
        ``(0, 1, 0, 0)`` where the arm has not run."""
        if self.seconds[index] <= 0:
            return 0.0, 1.0, 0.0, 0.0
        slope, center = self.context_line(index)
        return self.expected_tokens(index), self.mean_seconds(index), slope, center

    def _terms(self, index: int) -> tuple[float, float, float, float]:
        """:meth:`terms`, kept until :meth:`record` changes what they depend on."""
        terms = self._rates.get(index)
        if terms is None:
            terms = self._rates[index] = self.terms(index)
        return terms

    def _sums(self, index: int) -> tuple[float, float, float, float, float]:
        """``(trials, seconds, contexts, context_squares, context_seconds)`` of the arm's cost: ar's settled
        stretches where it has any (ar_seconds), else all its iterations."""
        if not self._speculative[index] and self.steady_trials[index] > 0.0:
            return (self.steady_trials[index], self.steady_seconds[index], self.steady_contexts[index],
                    self.steady_context_squares[index], self.steady_context_seconds[index])
        return (self.trials[index], self.seconds[index], self.contexts[index], self.context_squares[index],
                self.context_seconds[index])

    def _context_moments(self, index: int) -> tuple[float, float, float, float] | None:
        """``(mean seconds, center, spread, covariance)`` of the arm's cost sums (:meth:`_sums`): the mean
        seconds per iteration and context, the sum of trials * (context - center)^2 and of seconds *
        (context - center); None before any iteration."""
        trials, seconds, contexts, squares, products = self._sums(index)
        if trials <= 0.0:
            return None
        center = contexts / trials
        return seconds / trials, center, max(squares - center * contexts, 0.0), products - center * seconds

    def context_line(self, index: int) -> tuple[float, float]:
        """``(slope, center)``: how many seconds an iteration of the arm costs more per token of context, and
        the mean context of its iterations (``_PRIOR_CONTEXT``). The slope is the weighted least-squares one
        of its iterations, shrunk towards the pooled slope per second of cost times the arm's mean."""
        moments = self._context_moments(index)
        if moments is None:
            return 0.0, 0.0
        mean, center, spread, covariance = moments
        if self._context_scale is None:
            self._context_scale = self._pooled_context_scale()
        return (covariance + _PRIOR_CONTEXT * self._context_scale * mean) / (spread + _PRIOR_CONTEXT), center

    def _pooled_context_scale(self) -> float:
        """The slope per second of cost that fits every arm's iterations at once (each arm's slope taken as
        this times its mean seconds): 0 before any spread of contexts."""
        covariance = weight = 0.0
        for moments in map(self._context_moments, range(len(self.arms))):
            if moments is not None:
                mean, _, spread, arm_covariance = moments
                covariance += arm_covariance * mean
                weight += spread * mean * mean
        return covariance / weight if weight > 0.0 else 0.0

    def ceiling(self, index: int) -> float:
        """The most tokens per second arm ``index`` could reach: ``L + 1`` tokens (every draft kept) per
        iteration, over the least it can cost. That is its own mean seconds once it has run; before, the
        largest mean of the speculative arms it dominates (K' <= K and L' <= L: fewer paths and shorter
        blocks never cost more); ``inf`` when nothing bounds it."""
        ceiling = self._ceilings.get(index)
        if ceiling is None:
            arm = self.arms[index]
            if self.trials[index] > 0:
                least = self.ar_seconds(index) if arm.method == "ar" else self.seconds[index] / self.trials[index]
            else:
                least = max((self.seconds[j] / self.trials[j] for j, other in enumerate(self.arms)
                             if other.method != "ar" and self.trials[j] > 0 and other.num_paths <= arm.num_paths
                             and other.block_len <= arm.block_len), default=0.0)
            ceiling = self._ceilings[index] = (arm.block_len + 1) / least if least > 0 else math.inf
        return ceiling

    def switch_cost(self, index: int) -> float:
        """Seconds an iteration of arm ``index`` (a stretch of ar, ``_STRETCH``) costs more after another
        arm than after its own (at least 0), shrunk towards 0 by ``_SWITCH_PAIRS`` pairs."""
        return max(self.switch_sums[index] / (self.switch_pairs[index] + _SWITCH_PAIRS), 0.0)

    def switch_factor(self, index: int, horizon: float, context: float | None = None) -> float:
        """What choose() multiplies arm ``index``'s rate by when another arm ran last: its switching cost
        spread over the next ``horizon`` tokens (``_HORIZON``), as a factor (1 before it has run)."""
        rate = self.rate(index, context)
        return 1.0 / (1.0 + self.switch_cost(index) * rate / horizon)

    def choose(self, max_block: int | None = None, unfed_prompt: int = 0, context: float | None = None) -> int:
        """Index of the next arm. ``max_block`` excludes arms with longer blocks (near the end of a
        generation only a short block fits; ``ar`` always fits); it is also the generation's remaining
        tokens less one (the decoder passes it every step), over which an arm other than the one that
        ran last is rated with its switching cost spread (at most ``_HORIZON`` tokens; ``_SWITCH_PAIRS``).
        ``unfed_prompt``: the prompt tokens the draft has not been fed yet (a deferred prompt): the
        speculative arms are rated with that feed's estimated seconds spread over the remaining tokens
        (``_FEED_DECAY``; over ``_HORIZON`` without ``max_block``). ``context``: the committed tokens, at
        which every arm is rated (``_PRIOR_CONTEXT``; None: each at the contexts where it ran).

        A speculative arm whose :meth:`ceiling` is below the rate of the best arm that has finished
        exploring cannot win, so it is not tried (again) while that holds. Why: on a CPU a multi-path
        trial costs 10-40 ms against a 1.4 ms ``ar`` step; exploring every arm twice cost 0.2 s, 14% of a
        10-prompt run (bfloat16 bundled pair), where ``ar`` was the best arm all along. ``ar`` has no
        ceiling: measured in a slow moment (its cost depends on what ran before it, ``_STRETCH``), it was
        left out for good; UCB with aging retries it, a stretch a trial."""
        # One pass per list, no helper calls on the hot path: where one arm leads, a choice runs every
        # iteration (~2 ms in bfloat16 here), and the plain version cost ~19 us of it over 17 arms.
        if self._pending:
            self.flush()
        allowed = self._fitting.get(max_block)
        if allowed is None:
            allowed = self._fitting[max_block] = tuple(
                i for i, arm in enumerate(self.arms) if max_block is None or arm.block_len <= max_block)
        rates, runs, trials = self._rates, self.runs, self.trials
        costs, previous = self._switch_costs, self.previous
        horizon = _HORIZON if max_block is None or max_block >= _HORIZON else max_block + 1.0
        # (the deferred prompt's feed, spread over the generation's remaining tokens; 0: none to pay)
        feed = self.feed_seconds / self.feed_tokens * unfed_prompt if unfed_prompt > 0 and self.feed_tokens else 0.0
        remaining = _HORIZON if max_block is None else max_block + 1.0
        speculative = self._speculative
        leader, floor = None, 0.0
        at = context is not None
        effective = {}  # the explored arms' rates as this choice sees them
        for i in allowed:  # the leader: the first best rate among the explored arms, as leader() finds it
            if runs[i] >= _MIN_TRIALS:
                terms = rates.get(i)
                if terms is None:
                    terms = self._terms(i)
                seconds = terms[1]  # (its tokens over its seconds at this context, as rate() computes it)
                if at:
                    seconds = max(seconds + terms[2] * (context - terms[3]), _CONTEXT_FLOOR * seconds)
                rate = terms[0] / seconds
                if i != previous:
                    rate /= 1.0 + costs[i] * rate / horizon
                if feed and speculative[i]:
                    rate /= 1.0 + feed * rate / remaining
                effective[i] = rate
                if leader is None or rate > floor:
                    leader, floor = i, rate
        self.last_leader = leader
        candidates, best_rate = [], 0.0
        ceilings = self._ceilings
        for i in allowed:
            if leader is not None and i != leader and speculative[i]:  # (ar has none: see _STRETCH)
                ceiling = ceilings.get(i)
                if (ceiling if ceiling is not None else self.ceiling(i)) < floor:
                    continue  # cannot win
            if runs[i] < _MIN_TRIALS or (runs[i] < 2 * _MIN_TRIALS and not speculative[i]
                                         and self.steady_trials[i] == 0.0):
                return i  # (ar explores until a stretch follows one of its own, or twice as long: ar_seconds)
            rate = effective[i]  # (explored: rated in the first pass)
            candidates.append((i, rate))
            best_rate = rate if rate > best_rate else best_rate
        clock, stamps = self.clock, self.stamps
        aged = [_aged(trials[i], clock - stamps[i]) for i, _ in candidates]
        bonus = _BONUS * (best_rate or 1.0)
        log_total = math.log(max(sum(aged), 2.0))
        best, best_score = candidates[0][0], -math.inf
        for (i, rate), weight in zip(candidates, aged):  # the first of equal scores, as max() would
            score = rate + bonus * math.sqrt(log_total / max(weight, 1e-9))
            if score > best_score:
                best, best_score = i, score
        return best

    def leader(self) -> int | None:
        """The arm with the best rate among those that have finished exploring (None before any has)."""
        self.flush()
        explored = [i for i in range(len(self.arms)) if self.runs[i] >= _MIN_TRIALS]
        return max(explored, key=self.rate) if explored else None

    def record_prompt_feed(self, tokens: int, seconds: float) -> None:
        """The draft was fed a deferred prompt of ``tokens`` tokens in ``seconds`` (``_FEED_DECAY``)."""
        if tokens > 0:
            self.feed_seconds = self.feed_seconds * _FEED_DECAY + seconds
            self.feed_tokens = self.feed_tokens * _FEED_DECAY + tokens

    def record(self, index: int, tokens: int, seconds: float, switching: float = 0.0,
               context: float | None = None) -> None:
        """One iteration of arm ``index`` committed ``tokens`` (accepted drafts + 1) in ``seconds``
        (counted as at most ``_OUTLIER`` times the arm's mean, once it has run ``_MIN_TRIALS`` times;
        an iteration after another arm or a prefill less the arm's switching cost, _SWITCH_PAIRS), after
        ``switching`` seconds of work that only a switch to it needed (the draft's catch-up after ar:
        part of its switching cost, not of its seconds), at ``context`` committed tokens (None: at the
        arm's mean context, which tells nothing of its slope; _PRIOR_CONTEXT). Deferred records are
        applied first."""
        if self._pending:
            self.flush()
        self._record(index, tokens, seconds, switching, context=context)

    def record_rows(self, index: int, row_tokens: list[int], seconds: float, switching: float = 0.0,
                    context: float | None = None) -> None:
        """One step of a batch in which ``len(row_tokens)`` rows ran arm ``index`` together in ``seconds``,
        after ``switching`` seconds of work for the switch to it (the drafts' catch-up, see
        :meth:`record`): one iteration for the arm's sums, the clock and the aging (at the rows' mean
        tokens, and the seconds over the rows: what one row's iteration cost), and every row's accepted
        length for the family's acceptance. Why not a record per row: the clock then ran 16 iterations
        a step at 16 rows, so the other arms aged and were explored again 16x as often per step as for
        one sequence, and a stretch of ``ar`` (_STRETCH records) was one step. ``context``: the rows' mean
        context (see :meth:`record`). Deferred records are applied first."""
        if self._pending:
            self.flush()
        rows = len(row_tokens)
        accepted = row_tokens if self._speculative[index] else None
        self._record(index, sum(row_tokens) / rows, seconds / rows, switching / rows, accepted, context)

    def defer(self, index: int, tokens: int, seconds: float, switching: float = 0.0,
              context: float | None = None) -> None:
        """:meth:`record`, applied later: by the next :meth:`choose`, :meth:`record`, :meth:`flush`,
        :meth:`leader`, :meth:`best` or :meth:`table`, in order (see ``_HOLD``)."""
        self._pending.append((index, tokens, seconds, switching, context))

    def flush(self) -> None:
        """Apply the deferred records, oldest first."""
        pending, self._pending = self._pending, []
        for index, tokens, seconds, switching, context in pending:
            self._record(index, tokens, seconds, switching, None, context)

    def close_stretch(self) -> None:
        """Record ar's steps not yet recorded now, as a stretch of their number: another arm runs, or a
        generation ended (the next one starts after a prefill)."""
        if self._stretch is not None:
            index, steps, seconds, after, contexts = self._stretch
            self._stretch = None
            self._record_run(index, steps, steps, seconds, after, context=contexts / steps)

    def _record(self, index: int, tokens: float, seconds: float, switching: float = 0.0,
                accepted: list[int] | None = None, context: float | None = None) -> None:
        if self.runs[index] >= _MIN_TRIALS:
            seconds = min(seconds, _OUTLIER * self.seconds[index] / self.trials[index])
        if context is None:  # (at the arm's mean context: no evidence on its slope)
            context = self.contexts[index] / self.trials[index] if self.trials[index] > 0 else 0.0
        if not self._speculative[index]:  # a step of ar's stretch (see _STRETCH)
            stretch = self._stretch
            if stretch is None or stretch[0] != index:
                self.close_stretch()
                stretch = self._stretch = [index, 0, 0.0, self.previous, 0.0]
                self.previous = index
            stretch[1] += 1
            stretch[2] += seconds
            stretch[4] += context
            if stretch[1] >= _STRETCH:
                self.close_stretch()
            return
        self.close_stretch()
        self._record_run(index, 1, tokens, seconds, self.previous, switching, accepted, context)

    def _record_run(self, index: int, steps: int, tokens: float, seconds: float, after: int | None,
                    switching: float = 0.0, accepted: list[int] | None = None, context: float = 0.0) -> None:
        """Record ``steps`` consecutive iterations of arm ``index`` (more than one only for ar) that
        committed ``tokens`` in ``seconds`` in all, right after arm ``after`` (None: a prefill), after
        ``switching`` seconds of work for the switch (see :meth:`record`), at a mean ``context``;
        ``accepted``: the tokens of each row of a batch step (:meth:`record_rows`), for the acceptance
        (else ``tokens``)."""
        if self._switch_in is not None and self._switch_in[0] == index:  # a switch-in and the next run
            _, first_seconds, first_steps = self._switch_in  # (the excess over this run's seconds a step)
            self.switch_sums[index] = self.switch_sums[index] * _DECAY + (first_seconds - first_steps * seconds / steps)
            self.switch_pairs[index] = self.switch_pairs[index] * _DECAY + 1.0
        self._switch_in = None
        if index != after:
            self._switch_in = (index, seconds + switching, steps)
            # (its own seconds never count the switching work: at most ``seconds``)
            seconds = min(seconds, max(seconds + switching - self.switch_cost(index), 0.5 * seconds))
        self.previous = index
        if self.trials[index] > 0:  # the arm's sums, aged to now
            age = _aged(self.trials[index], self.clock - self.stamps[index]) / self.trials[index]
            self.tokens[index] *= age
            self.seconds[index] *= age
            self.trials[index] *= age
            self.steady_seconds[index] *= age
            self.steady_trials[index] *= age
            for sums in self._context_sums:
                sums[index] *= age
        self.clock += steps
        self.stamps[index] = self.clock
        decay = _DECAY ** steps  # (each step counts as one observation, as before)
        self.tokens[index] = self.tokens[index] * decay + tokens
        self.seconds[index] = self.seconds[index] * decay + max(seconds, 1e-9)
        self.trials[index] = self.trials[index] * decay + steps
        self.contexts[index] = self.contexts[index] * decay + steps * context
        self.context_squares[index] = self.context_squares[index] * decay + steps * context * context
        self.context_seconds[index] = self.context_seconds[index] * decay + max(seconds, 1e-9) * context
        if index == after and not self._speculative[index]:  # a settled stretch of ar (see ar_seconds)
            self.steady_seconds[index] = self.steady_seconds[index] * decay + seconds
            self.steady_trials[index] = self.steady_trials[index] * decay + steps
            self.steady_contexts[index] = self.steady_contexts[index] * decay + steps * context
            self.steady_context_squares[index] = self.steady_context_squares[index] * decay + steps * context * context
            self.steady_context_seconds[index] = self.steady_context_seconds[index] * decay + seconds * context
        self.runs[index] += 1
        if self.clock >= self._context_refresh:  # the pooled slope, and so every arm's line (_CONTEXT_REFRESH)
            self._context_refresh = self.clock + _CONTEXT_REFRESH
            scale = self._pooled_context_scale()
            if scale != self._context_scale:
                self._context_scale = scale
                self._rates.clear()
        self._switch_costs[index] = self.switch_cost(index)
        arm = self.arms[index]
        if arm.method == "ar":
            self._rates.pop(index, None)
            self._ceilings.pop(index, None)
        else:  # the family's acceptance and cost line change, so do all its arms' rates
            self._ceilings.clear()  # (a speculative arm's seconds bound the arms that dominate it)
            family = (arm.method, arm.num_paths)
            for row_tokens in (accepted if accepted is not None else (int(tokens),)):
                self.acceptance[family].record(min(row_tokens - 1, arm.block_len), arm.block_len)
            self._lines.pop(family, None)
            for member in self._members[family]:
                self._rates.pop(member, None)

    def observed(self) -> bool:
        """Whether an iteration has been recorded (or deferred, or is in ar's open stretch) since the
        policy was made: what :mod:`gbv.engine.auto_store` saves only then."""
        return self.clock > 0 or bool(self._pending) or self._stretch is not None

    def state_dict(self) -> dict:
        """What the policy has learned (its arms' decayed sums and its families' acceptance), as plain
        lists: :mod:`gbv.engine.auto_store` keeps it across processes. Deferred records and ar's open
        stretch are applied first."""
        self.flush()
        self.close_stretch()
        return {"arms": [arm.label for arm in self.arms],
                **{name: list(getattr(self, name)) for name in _STATE_LISTS},
                "acceptance": {f"{method}|{k}": {"kept": list(family.kept), "tried": list(family.tried)}
                               for (method, k), family in self.acceptance.items()},
                "prompt_feed": [self.feed_seconds, self.feed_tokens]}

    def load_state_dict(self, state: dict) -> None:
        """Start from ``state`` (:meth:`state_dict` of a policy with the same arms; ValueError else), its
        weight capped at ``_LOADED_TRIALS`` trials an arm and ``_LOADED_DEPTH_TRIALS`` iterations a depth
        (the means and rates as saved): what this process measures takes over within a few dozen
        iterations where the machine or the load has changed since, and no arm is explored again."""
        if state.get("arms") != [arm.label for arm in self.arms]:
            raise ValueError("the saved policy has other arms")
        lists = {name: [float(x) for x in state[name]] for name in _STATE_LISTS}
        if any(len(values) != len(self.arms) or not all(math.isfinite(x) and x >= -1e9 for x in values)
               for values in lists.values()):
            raise ValueError("the saved policy's sums do not fit its arms")
        families = {}
        for name, counts in state["acceptance"].items():
            method, k = name.rsplit("|", 1)
            family = self.acceptance.get((method, int(k)))
            kept, tried = [float(x) for x in counts["kept"]], [float(x) for x in counts["tried"]]
            if family is None or len(kept) != len(family.kept) or len(tried) != len(family.tried):
                raise ValueError(f"the saved policy's family {name} does not fit its arms")
            families[family] = (kept, tried)
        for i in range(len(self.arms)):
            scale = min(1.0, _LOADED_TRIALS / lists["trials"][i]) if lists["trials"][i] > 0 else 1.0
            for name in ("tokens", "seconds", "trials", "steady_seconds", "steady_trials", *_CONTEXT_LISTS):
                getattr(self, name)[i] = lists[name][i] * scale
            pairs = lists["switch_pairs"][i]
            scale = min(1.0, _LOADED_TRIALS / pairs) if pairs > 0 else 1.0
            self.switch_sums[i], self.switch_pairs[i] = lists["switch_sums"][i] * scale, pairs * scale
            self.runs[i] = min(int(lists["runs"][i]), 2 * _MIN_TRIALS)
            self._switch_costs[i] = self.switch_cost(i)
        for family, (kept, tried) in families.items():
            for depth in range(len(kept)):
                scale = min(1.0, _LOADED_DEPTH_TRIALS / tried[depth]) if tried[depth] > 0 else 1.0
                family.kept[depth], family.tried[depth] = kept[depth] * scale, tried[depth] * scale
            family._stale = True
        feed = state.get("prompt_feed")  # (absent from policies saved before it was kept)
        if feed is not None:
            seconds, tokens = float(feed[0]), float(feed[1])
            if not (math.isfinite(seconds) and math.isfinite(tokens) and seconds >= 0.0 and tokens >= 0.0):
                raise ValueError("the saved policy's prompt feed is not two sums")
            scale = min(1.0, _LOADED_FEEDS_TOKENS / tokens) if tokens > 0 else 1.0
            self.feed_seconds, self.feed_tokens = seconds * scale, tokens * scale
        self._rates.clear()
        self._ceilings.clear()
        self._lines.clear()
        self._context_scale = None

    def best(self) -> Arm:
        self.flush()
        return self.arms[max(range(len(self.arms)), key=self.rate)]

    def table(self) -> list[dict]:
        self.flush()
        return [{"arm": arm.label, "runs": self.runs[i], "tokens_per_s": self.rate(i)}
                for i, arm in enumerate(self.arms)]


# The per-arm sums of the iterations' contexts (AutoPolicy.context_line), and the per-arm lists of
# AutoPolicy.state_dict (runs too: a loaded arm has been explored).
_CONTEXT_LISTS = ("contexts", "context_squares", "context_seconds", "steady_contexts", "steady_context_squares",
                  "steady_context_seconds")
_STATE_LISTS = ("tokens", "seconds", "trials", "runs", "steady_seconds", "steady_trials", "switch_sums", "switch_pairs",
                *_CONTEXT_LISTS)
# A policy loaded from an earlier process (gbv.engine.auto_store) weighs at most this many trials an arm,
# and its families this many iterations a depth: enough that nothing is explored again, little enough
# that this process's own iterations outweigh it after a few dozen (the old sums decay by _DECAY each).
_LOADED_TRIALS = 20.0
_LOADED_DEPTH_TRIALS = 200.0
# ... and its prompt feeds (the draft's deferred prompts, _FEED_DECAY) this many prompt tokens: a few prompts.
_LOADED_FEEDS_TOKENS = 300.0


class _Acceptance:
    """Decayed counts of one verifier family (method, K): ``kept[d]`` = iterations whose accepted
    length reached ``d``, ``tried[d]`` = iterations that could have (block >= d and accepted >= d - 1);
    ``kept[d] / tried[d]`` estimates ``P(accepted >= d | accepted >= d - 1)``."""

    def __init__(self) -> None:
        self.kept: list[float] = [0.0]
        self.tried: list[float] = [0.0]
        # expected_tokens of every block length, 0 .. the longest (None before any observation), until
        # the next record: the arms of a family share its partial sums (one pass, not one per arm)
        self._expected: list[float] | None = None
        self._stale = True

    def grow(self, block_len: int) -> None:
        while len(self.kept) <= block_len:
            self.kept.append(0.0)
            self.tried.append(0.0)
        self._stale = True

    def record(self, accepted: int, block_len: int) -> None:
        self._stale = True
        for depth in range(1, len(self.kept)):
            self.kept[depth] *= _ACCEPTANCE_DECAY
            self.tried[depth] *= _ACCEPTANCE_DECAY
        for depth in range(1, min(accepted + 1, block_len) + 1):
            self.tried[depth] += 1.0
            if accepted >= depth:
                self.kept[depth] += 1.0

    def expected_tokens(self, block_len: int) -> float | None:
        """``1 + sum_{d <= L} prod_{j <= d} rate_j``, ``rate_j = (kept[j] + c rate_{j-1}) / (tried[j] + c)``
        with ``c = _PRIOR_DEPTH_TRIALS``, ``rate_0 = 1``: each depth's rate is shrunk towards the one
        above it, so a depth seen a few times (or never) continues near the rate of the shallower
        depths instead of at 0 or 1; None before any observation."""
        if self._stale:
            self._stale = False
            self._expected = None
            if self.tried[1] > 0.0:
                sums = [1.0]
                expected, reach, rate = 1.0, 1.0, 1.0
                for depth in range(1, len(self.kept)):
                    # Shrunk towards the rate of the depth above (the carried-forward estimate).
                    rate = (self.kept[depth] + _PRIOR_DEPTH_TRIALS * rate) / (self.tried[depth] + _PRIOR_DEPTH_TRIALS)
                    reach *= rate
                    expected += reach
                    sums.append(expected)
                self._expected = sums
        return None if self._expected is None else self._expected[block_len]


def _aged(trials: float, iterations: int) -> float:
    """``trials`` aged over ``iterations`` by ``_AGE`` each, but not below ``_MIN_TRIALS`` (nor above
    ``trials``)."""
    return max(trials * _AGE ** iterations, min(trials, _MIN_TRIALS))


_POLICIES: "weakref.WeakKeyDictionary[object, dict[tuple, AutoPolicy]]" = weakref.WeakKeyDictionary()


def policy_for(target, draft, key: tuple, arms: list[Arm]) -> AutoPolicy:
    """The policy shared by every generation with this target, draft and sampling ``key``; where
    policies are kept across processes (:mod:`gbv.engine.auto_store`: ``GBV_AUTO_CACHE``, on in the
    CLI), a new one starts from what an earlier process learned with the same pair, settings and
    machine, and is saved at exit."""
    per_target = _POLICIES.setdefault(target, {})
    full_key = (id(draft), key, tuple(arms))
    policy = per_target.get(full_key)
    if policy is None:
        from gbv.engine import auto_store

        policy = per_target[full_key] = AutoPolicy(arms)
        auto_store.attach(policy, target, draft, key)
    return policy


class AutoDecoder:
    """Runs each iteration of a base decoder (``Decoder`` or ``TreeDecoder``) with the arm the policy
    picks; everything else (tokens, caches, truncation) is the base decoder's."""

    def __init__(self, base, policy: AutoPolicy) -> None:
        self.base = base
        self.policy = policy
        self._held, self._hold_left = 0, 0  # the leader being held, and for how many more iterations
        # Each arm's decoder settings (method_settings), and the speculative arm the base decoder is set
        # to (None: its own method; an ar iteration leaves the settings as they are).
        self._settings = [method_settings(arm.method, arm.num_paths, arm.block_len) for arm in policy.arms]
        self._applied: int | None = None
        self._catch_up = getattr(base, "catch_up_draft", None)  # (the tree engine's; the HF path feeds the lag itself)
        self._plain_steps = getattr(base, "plain_steps", None)  # (the tree engine's: runs of ar's steps)
        # Where forwards are recorded as CUDA graphs (gbv.engine.static_steps), a shape's first uses
        # record it (milliseconds, once per process): not a cost of the arm that happened to meet it.
        self._models = (getattr(base, "target", None), getattr(base, "draft", None))
        # The shortest speculative block (0: none), and ar's arm: where fewer tokens remain, only ar fits
        # (see _TAIL_UNRECORDED).
        self._shortest = min((arm.block_len for arm in policy.arms if arm.method != "ar"), default=0)
        self._ar = next((i for i, arm in enumerate(policy.arms) if arm.method == "ar"), None)
        max_block = max(arm.block_len for arm in policy.arms)
        base.stats = GenerationStats(method=AUTO, num_paths=max(arm.num_paths for arm in policy.arms),
                                     block_len=max_block, depth_accept_counts=[0] * max_block)

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    @property
    def tokens(self) -> list[int]:  # (read every iteration: a property is cheaper than __getattr__)
        return self.base.tokens

    def prefill(self, prompt_ids) -> None:
        self.policy.flush()  # (the last generation's deferred records come before the prefill)
        self.policy.close_stretch()
        self.policy.previous = None  # the first iteration after a prefill is a switch-in (_SWITCH_PAIRS)
        # The draft is fed the prompt only if a speculative arm runs at all (the tree engine:
        # catch_up_draft), whichever arm leads: choose() charges that feed to the speculative arms while
        # it is still to be paid (_FEED_DECAY), so a generation speculates only where that pays.
        self.base.defer_draft = hasattr(self.base, "catch_up_draft")
        self.prompt_len = len(prompt_ids)
        self.base.prefill(prompt_ids)

    def step(self, block_len: int | None = None) -> list[int]:
        """One iteration with the chosen arm; ``block_len`` caps the block (near the end)."""
        policy, base = self.policy, self.base
        unrecorded = False
        if self._hold_left > 0 and (block_len is None or policy.arms[self._held].block_len <= block_len):
            index = self._held
            self._hold_left -= 1
        elif block_len is not None and block_len < self._shortest and self._ar is not None:
            # A generation's last token or two after another arm: only ar fits, and its switch-in steps are
            # left out of the policy's records (_TAIL_UNRECORDED).
            policy.flush()
            index, unrecorded = self._ar, _TAIL_UNRECORDED and policy.previous != self._ar
            self._held, self._hold_left = index, block_len
        else:
            # (the prompt tokens the draft still has to be fed: a cost the speculative arms are rated with)
            unfed = self.prompt_len - 1 - base.draft_len if self._catch_up is not None else 0
            index = policy.choose(block_len, unfed, len(base.tokens))
            if policy.arms[index].method == "ar":  # a stretch (see _STRETCH); as the leader, at least a hold
                stretches = 1 if policy.previous == index else _SWITCH_IN_STRETCHES
                self._held = index
                self._hold_left = max(stretches * _STRETCH, _HOLD if index == policy.last_leader else 1) - 1
            elif index == policy.last_leader:
                self._held, self._hold_left = index, _HOLD - 1
        settings = self._settings[index]
        block = settings[3]  # (0 for ar: a plain target step)
        switching = 0.0
        if block and base.draft_len < self.prompt_len - 1:
            # A deferred prompt is fed to the draft outside the arm's clock: it is the prefill, which
            # no arm was ever charged (charged to the arm, +10 ms on the bundled pair put BV L = 2, the
            # best arm in float32, under its ceiling for good). choose() charges it apart (_FEED_DECAY).
            # (TreeDecoder.catch_up_draft times it as prefill time, which its stats report apart)
            fed, prefill = self.prompt_len - 1 - base.draft_len, base.stats.time_prefill
            base.catch_up_draft(self.prompt_len - 1)
            policy.record_prompt_feed(fed, base.stats.time_prefill - prefill)
        if block and self._catch_up is not None and len(base.tokens) - base.draft_len > 2:
            # The tokens of plain steps since the draft last ran (after a BV iteration it lags by at
            # most the pending token and one more): fed first and timed apart, as a cost of switching
            # to speculation, which the policy should see (uncharged, near-tied arms were tried too
            # often: auto fell to 0.94x ar in bfloat16, where ar is the best arm), but not in the arm's
            # own seconds: after a stretch of ar (_STRETCH) the catch-up of ~50 tokens put BV's first
            # trial at 2-3x its cost, and BV under its ceiling for good. (No device sync here: on a GPU
            # what the catch-up leaves running finishes inside the step's clock, as before.)
            switch_start, recorded = time.perf_counter(), recording_seconds(self._models)
            self._catch_up(len(base.tokens) - 1)
            switching = time.perf_counter() - switch_start - (recording_seconds(self._models) - recorded)
        start, recorded = time.perf_counter(), recording_seconds(self._models)
        if block and index != self._applied:
            base.method, base.verifier, base.num_paths, base.block_len = settings
            self._applied = index
        if block or self._plain_steps is None:
            new = base.step(block)
            steps = 1
        else:
            # ar where its steps run several as one call (static steps, PlainLoop): what is left of the
            # stretch (or the hold) at once, each step recorded as one, with the run's mean seconds.
            limit = self._hold_left + 1 if block_len is None else min(self._hold_left + 1, block_len + 1)
            new = self._plain_steps(limit)
            steps = len(new)
            self._hold_left -= steps - 1
        # The step ended by reading its tokens back to the host, so the device work is done.
        seconds = time.perf_counter() - start - (recording_seconds(self._models) - recorded)
        if unrecorded:
            self._hold_left = 0
        else:  # (at the context each step started from: the committed tokens before it)
            context = len(base.tokens) - len(new)
            if steps == 1:
                policy.defer(index, len(new), seconds, switching, context)
            else:
                for step in range(steps):
                    policy.defer(index, 1, seconds / steps, 0.0, context + step)
        label = policy.arms[index].label
        arms = base.stats.auto_arms
        arms[label] = arms.get(label, 0) + steps
        return new

    def truncate(self, length: int) -> None:
        self.base.truncate(length)
