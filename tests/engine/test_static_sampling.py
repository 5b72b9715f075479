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
