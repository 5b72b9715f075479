"""``auto``'s policies kept across processes (gbv.engine.auto_store): saved and loaded as they were
(their weight capped), keyed by pair, settings and machine, off where GBV_AUTO_CACHE says so, and a
file that does not fit is ignored."""

from __future__ import annotations

import json
import logging
import random
import weakref

import pytest
import torch

import gbv.engine.auto as auto
import gbv.engine.auto_store as auto_store
from gbv.engine.auto import Arm, AutoPolicy
from gbv.engine.generate import generate
from gbv.models.loading import ModelPair

from engine_toy import hf_pair

ARMS = [Arm("ar", 0, 0), Arm("block", 1, 2), Arm("block", 1, 4), Arm("gbv", 2, 4)]


def _learned_policy(iterations: int = 300) -> AutoPolicy:
    """Synthetic arms: ar 1 token in 1 ms; BV keeps each drafted token with probability 0.85, L = 2 in
    2 ms (2.57 tokens expected), L = 4 in 2.5 ms (3.70: the best); GBV K = 2 L = 4 0.9 in 6 ms."""
    rng = random.Random(0)
    seconds = {0: 0.001, 1: 0.002, 2: 0.0025, 3: 0.006}
    policy = AutoPolicy(ARMS)
    for _ in range(iterations):
        index = policy.choose()
        arm, tokens = ARMS[index], 1
        while tokens <= arm.block_len and rng.random() < (0.9 if arm.num_paths > 1 else 0.85):
            tokens += 1
        policy.record(index, tokens, seconds[index])
    return policy


def test_a_loaded_policy_rates_its_arms_as_the_saved_one_and_explores_nothing():
    saved = _learned_policy()
    state = json.loads(json.dumps(saved.state_dict()))  # (through JSON, as on disk)
    loaded = AutoPolicy(ARMS)
    loaded.load_state_dict(state)
    for i in range(len(ARMS)):
        if saved.trials[i] > 0:  # the same means (the rate's cost line weighs them by trials: close)
            assert loaded.seconds[i] / loaded.trials[i] == pytest.approx(saved.seconds[i] / saved.trials[i], rel=1e-12)
            assert loaded.expected_tokens(i) == pytest.approx(saved.expected_tokens(i), rel=0.01)
            assert loaded.rate(i) == pytest.approx(saved.rate(i), rel=0.01)
            assert loaded.trials[i] <= auto._LOADED_TRIALS + 1e-9
    family, before = loaded.acceptance[("block", 1)], saved.acceptance[("block", 1)]
    for depth in range(1, len(family.kept)):  # each depth's rate as saved, its weight capped
        assert family.kept[depth] / family.tried[depth] == pytest.approx(before.kept[depth] / before.tried[depth],
                                                                          rel=1e-12)
    assert max(family.tried) <= auto._LOADED_DEPTH_TRIALS + 1e-9 < max(before.tried)
    assert ARMS[loaded.choose()] == ARMS[saved.leader()] == Arm("block", 1, 4)
    fresh = AutoPolicy(ARMS)
    assert fresh.choose() == 0  # (a fresh policy explores first: the negative control)


def test_the_prompt_feed_is_kept_and_a_policy_saved_without_it_still_loads():
    """The draft's prompt-feed sums (``_FEED_DECAY``) go with the policy, their weight capped at
    ``_LOADED_FEEDS_TOKENS`` tokens and their rate per token as saved; a file from before they were kept loads
    with none; negative sums are refused."""
    saved = _learned_policy(50)
    for _ in range(20):
        saved.record_prompt_feed(100, 0.004)
    state = json.loads(json.dumps(saved.state_dict()))
    loaded = AutoPolicy(ARMS)
    loaded.load_state_dict(state)
    assert loaded.feed_seconds / loaded.feed_tokens == pytest.approx(4e-5, rel=1e-12)
    assert loaded.feed_tokens == pytest.approx(auto._LOADED_FEEDS_TOKENS) and auto._LOADED_FEEDS_TOKENS < saved.feed_tokens
    del state["prompt_feed"]
    older = AutoPolicy(ARMS)
    older.load_state_dict(state)
    assert older.feed_tokens == 0.0
    state["prompt_feed"] = [-1.0, 100.0]
    with pytest.raises(ValueError, match="prompt feed"):
        AutoPolicy(ARMS).load_state_dict(state)


def test_loading_another_policy_is_an_error():
    state = _learned_policy(50).state_dict()
    with pytest.raises(ValueError, match="other arms"):
        AutoPolicy(ARMS[:3]).load_state_dict(state)
    state["trials"] = state["trials"][:2]
    with pytest.raises(ValueError, match="do not fit"):
        AutoPolicy(ARMS).load_state_dict(state)


@pytest.fixture
def named_pair():
    target, draft = hf_pair("llama", vocab=32, seed=3)
    target.config._name_or_path, draft.config._name_or_path = "toy-target", "toy-draft"
    return ModelPair(target, draft)


@pytest.fixture
def fresh_store(monkeypatch, tmp_path):
    """A store directory of the test's own, no policies in memory, and no hook left behind."""
    monkeypatch.setenv("GBV_AUTO_CACHE", str(tmp_path))
    monkeypatch.setattr(auto, "_POLICIES", weakref.WeakKeyDictionary())
    monkeypatch.setattr(auto_store, "_attached", [])
    monkeypatch.setattr(auto_store, "_exit_hook", True)  # (save_all is called by hand)
    return tmp_path


def _auto(pair, seed: int = 0):
    return generate(pair, prompt_ids=[1, 2, 3], method="auto", max_new_tokens=40, eos_token_id=[], seed=seed)


def test_a_new_process_starts_where_the_last_one_stopped(named_pair, fresh_store, monkeypatch):
    _auto(named_pair)
    first = next(iter(auto._POLICIES[named_pair.target].values()))
    auto_store.save_all()
    files = list(fresh_store.glob("policy-*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["key"]["target"].startswith("toy-target|") and saved["key"]["threads"] == torch.get_num_threads()
    monkeypatch.setattr(auto, "_POLICIES", weakref.WeakKeyDictionary())  # "the next process"
    policy = auto.policy_for(named_pair.target, named_pair.draft, *_policy_args(named_pair))
    assert policy is not first and policy.runs == [min(r, 2 * auto._MIN_TRIALS) for r in first.runs]
    assert sum(policy.trials) > 0
    # Another machine (here: another thread count) has a file of its own.
    other = auto_store.policy_key(named_pair.target, named_pair.draft, _policy_args(named_pair)[0], policy.arms)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    assert auto_store.policy_key(named_pair.target, named_pair.draft, _policy_args(named_pair)[0], policy.arms) != other


def _policy_args(pair) -> tuple:
    """policy_for's key and arms for the settings _auto uses (what make_decoder passes)."""
    from gbv.engine.sampling import SamplingConfig

    config = SamplingConfig(1.0, 0, 1.0)
    return (config, config, 32), auto.default_arms(False, True)


def test_a_file_that_does_not_fit_is_ignored(named_pair, fresh_store, caplog):
    _auto(named_pair)
    auto_store.save_all()
    path = next(fresh_store.glob("policy-*.json"))
    path.write_text(path.read_text()[:50])  # a torn write
    auto._POLICIES.clear()
    with caplog.at_level(logging.DEBUG, logger="gbv"):
        policy = auto.policy_for(named_pair.target, named_pair.draft, *_policy_args(named_pair))
    assert sum(policy.runs) == 0 and "ignoring the saved policy" in caplog.text
    _auto(named_pair, seed=1)  # (and it still decodes, and is saved again)
    auto_store.save_all()
    assert json.loads(path.read_text())["policy"]["arms"] == [arm.label for arm in policy.arms]


def test_off_unless_asked_and_where_asked(named_pair, fresh_store, monkeypatch, tmp_path):
    monkeypatch.setenv("GBV_AUTO_CACHE", "0")
    _auto(named_pair)
    auto_store.save_all()
    assert not list(fresh_store.glob("*.json")) and auto_store._attached == []
    monkeypatch.delenv("GBV_AUTO_CACHE")
    monkeypatch.setattr(auto_store, "_by_default", False)  # (a CLI test of this process may have set it)
    assert auto_store.cache_dir() is None  # the library's default
    monkeypatch.setattr(auto_store, "_by_default", True)  # what the CLI sets
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert auto_store.cache_dir() == tmp_path / "xdg" / "gbv" / "auto"
    monkeypatch.setenv("GBV_AUTO_CACHE", "0")
    assert auto_store.cache_dir() is None


def test_models_without_a_name_are_not_stored(fresh_store):
    target, draft = hf_pair("llama", vocab=32, seed=4)
    target.config._name_or_path = ""
    _auto(ModelPair(target, draft))
    auto_store.save_all()
    assert not list(fresh_store.glob("*.json"))
