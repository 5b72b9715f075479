"""Static calls that also sample (gbv/engine/static_sampling.py): an iteration's drafting as one call
(``DraftLoop``) and a step with its law and draw (``SampledStep``). On the CPU they run without
capturing (``GBV_CUDA_GRAPHS=static``); under ``GBV_TEST_DEVICE=cuda`` they record and replay graphs.
Each is checked against the step-by-step torch path of the same decoder on the same uniforms."""

from __future__ import annotations

import pytest
import torch

import gbv.engine.static_sampling as static_sampling
import gbv.engine.static_steps as static_steps
import gbv.engine.tree_decoder as tree_decoder
from gbv.engine.decoder import make_decoder
from gbv.engine.sampling import SamplingConfig

from engine_toy import TEST_DEVICE, hf_pair

MODE = "graph" if TEST_DEVICE.type == "cuda" else "static"
# Block lengths of successive iterations: 0 is a plain target step, so the draft lags by more than
# MAX_CHAIN tokens before the iteration after a run of them (its chain is then split).
# Largest gap between the two forms' laws (float rounding: the static form attends the whole cache).
ATOL = 2e-5
SCHEDULE = [None, None, 0, None, 2, 0, 0, 0, 0, 0, 0, None, None, 3, None, None]


class _ReplayByRunning:
    """A stand-in for a CUDA graph on the CPU: replaying runs the recorded call again, as a graph's
    replay repeats its kernels on the buffers as they are then."""

    def __init__(self, call: static_steps.Recorded, cache) -> None:
        self.call, self.cache = call, cache

    def replay(self) -> None:
        self.call.output = self.call._run(self.cache)


def _record_by_running(self, cache):
    """``Recorded._capture`` as on CUDA (a warm-up run for real, then a recording that runs nothing),
    with a graph that replays by running again."""
    warm = self._run(cache)
    self.graph = _ReplayByRunning(self, cache)
    return warm


def _run(monkeypatch, mode: str, method: str, rows: int, temperature: float, arch: str,
         replay_by_running: bool = False):
    """Decode SCHEDULE with the lean views made under ``GBV_CUDA_GRAPHS=mode`` (the torch forward, not
    the host one); returns (tokens of each iteration, (drafted, q) of each drafting, the decoder).
    ``replay_by_running``: on the CPU, record and replay as on CUDA, with :class:`_ReplayByRunning`."""
    monkeypatch.setenv("GBV_HOST_FORWARD", "0")
    monkeypatch.setenv("GBV_CUDA_GRAPHS", mode)
    target, draft = hf_pair(arch, vocab=40, seed=6)  # new models: new lean views, which read the mode
    sampling = SamplingConfig(temperature)
    decoder = make_decoder(target, draft, method, rows, 4, 40, sampling, sampling, 3, TEST_DEVICE)
    if replay_by_running:
        monkeypatch.setattr(static_steps.Recorded, "_capture", _record_by_running)
        for lean in (decoder.target, decoder.draft):
            lean.steps.capture = True
    drafts = []
    draft_paths = decoder._draft_paths

    def recorded(*args):
        drafted, q = draft_paths(*args)
        drafts.append((drafted.cpu(), q.cpu()))
        return drafted, q

    decoder._draft_paths = recorded
    with torch.inference_mode():
        decoder.prefill([1, 2, 3, 4, 5])
        news = [decoder.step(block) for block in SCHEDULE]
    return news, drafts, decoder


@pytest.mark.parametrize("method,rows,temperature,arch", [
    ("gbv", 3, 1.0, "llama"), ("traversal", 2, 0.7, "qwen3"), ("block", 1, 1.0, "llama"),
    ("token", 1, 0.0, "llama"), ("specinfer", 3, 0.0, "llama"), ("block", 1, 0.5, "qwen3")])
def test_static_calls_equal_the_step_by_step_path(monkeypatch, method, rows, temperature, arch):
    """The one-call drafting gives the laws q (to float rounding) and the tokens of the step-by-step
    drafting, and whole iterations commit the same tokens (the target's sampled steps too): one path
    and several, greedy and sampled, a draft lagging by more than MAX_CHAIN tokens."""
    eager_news, eager_drafts, eager = _run(monkeypatch, "0", method, rows, temperature, arch)
    static_news, static_drafts, decoder = _run(monkeypatch, MODE, method, rows, temperature, arch)
    assert static_news == eager_news
    assert _cache_gap(eager, decoder) < ATOL  # (the commits' moves: recorded ones for several paths)
    assert len(static_drafts) == len(eager_drafts) == sum(block != 0 for block in SCHEDULE)
    for (drafted_e, q_e), (drafted_s, q_s) in zip(eager_drafts, static_drafts):
        assert torch.equal(drafted_s, drafted_e)
        torch.testing.assert_close(q_s, q_e, atol=ATOL, rtol=0)
    draft_keys = [key for key in decoder.draft_cache.steps if key[0] == "draft"]
    target_keys = [key for key in decoder.target_cache.steps if key[0] == "sampled"]
    assert {key[1] for key in draft_keys} >= {1}  # (the lagging chain was split: its loops have chains of 1-2)
    assert max(key[1] for key in draft_keys) <= static_sampling.MAX_CHAIN
    assert {key[-1] for key in target_keys} == {True, False}  # plain steps draw; passes give laws
    moves = [key for cache in (decoder.target_cache, decoder.draft_cache) for key in cache.steps if key[0] == "move"]
    assert bool(moves) == (rows > 1 and temperature > 0)  # (one path's nodes sit at their depth: nothing moves)
    # Fewer shapes to record: tries padded to a multiple of 8 nodes, moves to a power of two.
    assert all(key[1] % tree_decoder.TREE_MULTIPLE == 0 for key in target_keys if key[2])
    assert all(key[1] & (key[1] - 1) == 0 for key in moves)


def _cache_gap(eager, static) -> float:
    """Largest gap between two decoders' caches over what each model has committed (target: all but the
    pending token; draft: its draft length)."""
    assert eager.tokens == static.tokens and eager.draft_len == static.draft_len
    gap = 0.0
    for cache_name, length in (("target_cache", len(eager.tokens) - 1), ("draft_cache", eager.draft_len)):
        a, b = getattr(eager, cache_name), getattr(static, cache_name)
        if a is None and b is None:  # (ar: no draft)
            continue
        for store in ("keys", "values"):
            for x, y in zip(getattr(a, store), getattr(b, store)):
                gap = max(gap, (x[:, :, :length].float() - y[:, :, :length].float()).abs().max().item())
    return gap


def test_a_move_off_by_one_slot_is_caught(monkeypatch):
    """Negative control: a recorded commit that moves each accepted node's entries one slot late leaves
    other caches than the step-by-step commit, and the comparison above sees it."""
    _, _, eager = _run(monkeypatch, "0", "gbv", 3, 1.0, "llama")

    def late(self, cache):
        src, dst = self.indices
        for store in (cache.keys, cache.values):
            for tensor in store:
                tensor[0, :, dst + 1] = tensor[0, :, src]
        return ()

    monkeypatch.setattr(static_steps.StaticMove, "_run", late)
    _, _, static = _run(monkeypatch, MODE, "gbv", 3, 1.0, "llama")
    assert eager.tokens != static.tokens or _cache_gap(eager, static) > 10 * ATOL


def test_a_loop_whose_tips_see_their_cousins_is_caught(monkeypatch):
    """Negative control: a DraftLoop whose path tips attend every drafted node (their cousins too, a
    flat mask) gives other laws than the step-by-step drafting, and the comparison above sees it."""
    original = static_sampling.DraftLoop._forward

    def flat(self, tokens, positions, slots, mask, cache, last_only):
        if tokens.shape[0] > 1 and not last_only:  # a depth over several tips
            mask = (self.columns <= slots.max()).expand(tokens.shape[0], -1)[None, None]
        return original(self, tokens, positions, slots, mask, cache, last_only)

    _, eager_drafts, _ = _run(monkeypatch, "0", "gbv", 3, 1.0, "llama")
    monkeypatch.setattr(static_sampling.DraftLoop, "_forward", flat)
    _, static_drafts, _ = _run(monkeypatch, MODE, "gbv", 3, 1.0, "llama")
    gaps = [(q_s - q_e).abs().max().item() for (_, q_e), (_, q_s) in zip(eager_drafts, static_drafts)]
    assert max(gaps) > 10 * ATOL  # (the toy's laws are near uniform over 40 tokens: gaps are small)


@pytest.mark.skipif(TEST_DEVICE.type == "cuda", reason="on CUDA the tests above record real graphs")
@pytest.mark.parametrize("method,rows", [("gbv", 3), ("block", 1)])
def test_recorded_then_replayed_as_on_cuda(monkeypatch, method, rows):
    """The record-then-replay sequence of CUDA (a call made, recorded at its second use, the suite's
    GBV_RECORD_AT, with a warm-up run for real, replayed from then on) with replays that run the call
    again: the same tokens, laws and caches as the step-by-step path. A commit's move is not
    repeatable (its sources and targets may overlap), so the replay right after its recording is
    skipped; without that the move runs twice and the caches differ."""
    eager_news, eager_drafts, eager = _run(monkeypatch, "0", method, rows, 1.0, "llama")
    news, drafts, decoder = _run(monkeypatch, "static", method, rows, 1.0, "llama", replay_by_running=True)
    assert news == eager_news and _cache_gap(eager, decoder) < ATOL
    for (drafted_e, q_e), (drafted_s, q_s) in zip(eager_drafts, drafts):
        assert torch.equal(drafted_s, drafted_e)
        torch.testing.assert_close(q_s, q_e, atol=ATOL, rtol=0)
    recorded = [call for cache in (decoder.target_cache, decoder.draft_cache) for call in cache.steps.values()
                if call.graph is not None]
    assert {type(call).__name__ for call in recorded} >= {"DraftLoop", "SampledStep"}
    if rows > 1:
        assert any(isinstance(call, static_steps.StaticMove) for call in recorded)
        monkeypatch.setattr(static_steps.StaticMove, "REPEATABLE", True)  # the negative control
        _, _, twice = _run(monkeypatch, "static", method, rows, 1.0, "llama", replay_by_running=True)
        assert eager.tokens != twice.tokens or _cache_gap(eager, twice) > 10 * ATOL


# Plain steps (ar) in runs (PlainLoop): the caps of successive calls of ``step`` (None: a run of
# PLAIN_RUN; n: at most n + 1 steps, as the row loop caps a block near the end): runs of 8, 2, 1, 4, 8, 2.
PLAIN_SCHEDULE = [None, 2, 0, 3, None, 1]


def _plain(monkeypatch, mode: str, temperature: float, arch: str, schedule, replay_by_running: bool = False):
    """Decode ``schedule`` with method ``ar`` under ``GBV_CUDA_GRAPHS=mode``; returns the decoder. The
    eager form ("0") steps once per call: it runs ``step(0)`` until it has as many tokens as ``schedule``
    gave the static form (``_plain(..., schedule=count)`` with an int)."""
    monkeypatch.setenv("GBV_HOST_FORWARD", "0")
    monkeypatch.setenv("GBV_CUDA_GRAPHS", mode)
    target, _ = hf_pair(arch, vocab=40, seed=6)
    sampling = SamplingConfig(temperature)
    decoder = make_decoder(target, None, "ar", 1, 1, 40, sampling, sampling, 3, TEST_DEVICE)
    if replay_by_running:
        monkeypatch.setattr(static_steps.Recorded, "_capture", _record_by_running)
        decoder.target.steps.capture = True
    with torch.inference_mode():
        decoder.prefill([1, 2, 3, 4, 5])
        if isinstance(schedule, int):
            while len(decoder.tokens) < schedule:
                assert len(decoder.step(0)) == 1
        else:
            for block in schedule:
                decoder.step(block)
    return decoder


@pytest.mark.parametrize("temperature,arch", [(1.0, "llama"), (0.0, "llama"), (0.6, "qwen3")])
def test_plain_runs_equal_single_steps(monkeypatch, temperature, arch):
    """ar's steps in runs of one call each commit the tokens (the same uniforms, in the same order) and
    leave the caches of one step at a time; each run as long as its cap allows, in powers of two."""
    static = _plain(monkeypatch, MODE, temperature, arch, PLAIN_SCHEDULE)
    eager = _plain(monkeypatch, "0", temperature, arch, len(static.tokens))
    assert len(static.tokens) == 5 + 8 + 2 + 1 + 4 + 8 + 2
    assert static.stats.target_calls == eager.stats.target_calls == len(static.tokens) - 5
    assert _cache_gap(eager, static) < ATOL
    keys = static.target_cache.steps
    assert sorted(key[1] for key in keys if key[0] == "plain") == [2, 4, 8]
    assert any(key[0] == "sampled" for key in keys)  # (a cap of one step: the sampled step)


def _broken_run(reuse_uniform: bool, feed_pending: bool):
    """``PlainLoop._run`` with one fault: every step drawn from the first uniform, or fed the pending
    token instead of the one just drawn."""
    def run(self, cache):
        columns, capacity, token, drawn = self.columns, self.columns.shape[0], self.packed[1:], []
        for i in range(self.count):
            slot = self.packed[:1] + i
            mask = (columns[None, :] <= slot[:, None])[None, None]
            logits = static_sampling.static_forward(self.lean, (self.packed[1:] if feed_pending else token)[None],
                                                    slot[None], slot, mask, cache, capacity,
                                                    last_only=True)[0, :, :self.vocab]
            token = static_sampling._draw(static_sampling.process_logits(logits, self.config), self.config,
                                          self.uniforms[0 if reuse_uniform else i])
            drawn.append(token)
        return torch.cat(drawn)
    return run


def test_a_run_that_reuses_a_uniform_or_feeds_a_stale_token_is_caught(monkeypatch):
    """Negative controls: a run that draws every step from its first uniform, or that feeds each step
    the pending token instead of the one just drawn, commits other tokens than one step at a time;
    the fault-free form of the same code (the control's control) commits the same."""
    eager = _plain(monkeypatch, "0", 1.0, "llama", len(_plain(monkeypatch, MODE, 1.0, "llama", PLAIN_SCHEDULE).tokens))
    for reuse_uniform, feed_pending in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(static_sampling.PlainLoop, "_run", _broken_run(reuse_uniform, feed_pending))
        tokens = _plain(monkeypatch, MODE, 1.0, "llama", PLAIN_SCHEDULE).tokens
        assert (tokens == eager.tokens) == (not reuse_uniform and not feed_pending)


@pytest.mark.skipif(TEST_DEVICE.type == "cuda", reason="on CUDA the tests above record real graphs")
def test_plain_runs_recorded_then_replayed_as_on_cuda(monkeypatch):
    """The record-then-replay sequence of CUDA for ar's runs: the same tokens and caches as one step at
    a time (a run is repeatable: its warm-up and its first replay write the same entries)."""
    static = _plain(monkeypatch, "static", 1.0, "llama", PLAIN_SCHEDULE + PLAIN_SCHEDULE, replay_by_running=True)
    eager = _plain(monkeypatch, "0", 1.0, "llama", len(static.tokens))
    assert _cache_gap(eager, static) < ATOL
    assert any(isinstance(call, static_sampling.PlainLoop) and call.graph is not None
               for call in static.target_cache.steps.values())


def test_auto_runs_its_ar_stretches_as_plain_runs(monkeypatch):
    """``auto`` where ar's steps run in runs: a stretch of ar as runs of PLAIN_RUN, each step counted
    once; with ar its only arm (no draft), the tokens of ``ar`` itself from the same seed."""
    from gbv.engine import auto
    from gbv.engine.generate import generate
    from gbv.models.loading import ModelPair

    monkeypatch.setenv("GBV_HOST_FORWARD", "0")
    monkeypatch.setenv("GBV_CUDA_GRAPHS", MODE)
    target, _ = hf_pair("llama", vocab=40, seed=6)
    pair = ModelPair(target=target, draft=None, tokenizer=None)
    runs = []
    real = tree_decoder.TreeDecoder.plain_steps

    def counted(self, limit):
        new = real(self, limit)
        runs.append(len(new))
        return new

    monkeypatch.setattr(tree_decoder.TreeDecoder, "plain_steps", counted)
    settings = dict(prompt_ids=[1, 2, 3, 4, 5], temperature=1.0, max_new_tokens=37, eos_token_id=[], seed=3)
    out = generate(pair, method="auto", **settings)
    assert runs[:2] == [static_sampling.PLAIN_RUN] * 2 and sum(runs) == 37
    assert auto._STRETCH == 2 * static_sampling.PLAIN_RUN  # (a stretch: two runs)
    assert out.stats.auto_arms == {"ar": 37}
    assert out.token_ids == generate(pair, method="ar", **settings).token_ids


def test_plain_run_setting(monkeypatch):
    """GBV_PLAIN_RUN: 8 by default, any power of two; anything else is one clear error (a GbvError: the
    CLI prints one line and exits with 2). On the host forward a run is as long as the cap allows, up to the
    setting (one compiled call, no recording per length); where neither runs, a run is one step."""
    from gbv.errors import GbvError

    monkeypatch.delenv("GBV_PLAIN_RUN", raising=False)
    assert static_sampling._plain_run() == 8
    monkeypatch.setenv("GBV_PLAIN_RUN", "16")
    assert static_sampling._plain_run() == 16
    for bad in ("0", "3", "-8", "eight"):
        monkeypatch.setenv("GBV_PLAIN_RUN", bad)
        with pytest.raises(GbvError, match="GBV_PLAIN_RUN must be a power of two"):
            static_sampling._plain_run()
    monkeypatch.setenv("GBV_CUDA_GRAPHS", "0")
    target, _ = hf_pair("llama", vocab=40, seed=6)
    lean = tree_decoder.lean_model(target)
    if lean.host_forward is not None:
        assert [static_sampling.plain_run_length(lean, limit) for limit in (None, 1, 3, 7, 8, 100)] == [8, 1, 3, 7, 8, 8]
    monkeypatch.setenv("GBV_HOST_FORWARD", "0")
    target, _ = hf_pair("llama", vocab=40, seed=6)
    assert static_sampling.plain_run_length(tree_decoder.lean_model(target), 100) == 1
    monkeypatch.setenv("GBV_CUDA_GRAPHS", "static")
    monkeypatch.setenv("GBV_HOST_FORWARD", "0")
    target, _ = hf_pair("llama", vocab=40, seed=6)
    lean = tree_decoder.lean_model(target)
    assert [static_sampling.plain_run_length(lean, limit) for limit in (None, 1, 3, 7, 8, 100)] == [8, 1, 2, 4, 8, 8]
