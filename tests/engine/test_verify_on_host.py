"""Verifying on the host for a device's models (``verifies_on_host``): what every decoder does off the
CPU unless ``GBV_VERIFY_ON_DEVICE=1``. Forced here on CPU tensors, so that what a GPU runs (a host
generator for the verifier, separate from the drafts') is checked for its law by the same chi-square
test as the default path, and a broken variant (the verifier replaying the drafts' own stream) is
caught."""

from __future__ import annotations

import pytest
import torch

import gbv.engine.batch as engine_batch
import gbv.engine.decoder as engine_decoder
from gbv.engine.batch import BatchTreeDecoder
from gbv.engine.decoder import host_copies, verifies_on_host
from gbv.engine.sampling import SamplingConfig
from gbv.verify import TorchRandom, get_verifier

from engine_toy import TEST_DEVICE, hf_pair, sharp_llama_pair
from test_exactness import RUNS, check, toy_pair  # noqa: F401  (toy_pair: a fixture)


@pytest.fixture
def on_host(monkeypatch):
    monkeypatch.setattr(engine_decoder, "verifies_on_host", lambda device: True)
    monkeypatch.setattr(engine_batch, "verifies_on_host", lambda device: True)


def test_verifies_on_host_off_the_cpu_only(monkeypatch):
    monkeypatch.delenv("GBV_VERIFY_ON_DEVICE", raising=False)
    assert not verifies_on_host("cpu") and not verifies_on_host(torch.device("cpu"))
    assert verifies_on_host("cuda") and verifies_on_host("meta")
    monkeypatch.setenv("GBV_VERIFY_ON_DEVICE", "1")
    assert not verifies_on_host("cuda")


def test_host_copies_of_host_tensors_are_the_tensors():
    tensors = (torch.arange(3), torch.ones(2, 2))
    assert all(a is b for a, b in zip(host_copies(*tensors), tensors))


@pytest.mark.parametrize("method", ["gbv", "spectr"])
def test_law_with_the_verifier_on_a_host_generator(toy_pair, on_host, method):  # noqa: F811
    stat, threshold = check(toy_pair, RUNS, 1.0, method=method, num_paths=3, block_len=2)
    assert stat < threshold, f"{method}: chi2 {stat:.1f} >= {threshold:.1f}"


def test_law_on_the_tree_engine_with_the_verifier_on_a_host_generator(on_host):
    stat, threshold = check(sharp_llama_pair(), 800, 1.0, method="gbv", num_paths=3, block_len=2)
    assert stat < threshold, f"chi2 {stat:.1f} >= {threshold:.1f}"


@pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="on a GPU the drafts' generator is another kind: nothing replays")
def test_negative_control_verifier_replaying_the_drafts_stream(on_host, monkeypatch):
    """host_random must not hand the verifier the drafts' own stream: with the decoder's seed itself,
    on the tree engine (whose draws take their uniforms from the same kind of source) the coins
    replay the uniforms the draws used, and the law breaks."""
    monkeypatch.setattr(engine_decoder, "host_random", lambda seed: TorchRandom(seed=seed))
    stat, threshold = check(sharp_llama_pair(), 800, 1.0, method="token", num_paths=1, block_len=2)
    assert stat > threshold, f"broken variant not detected: chi2 {stat:.1f} < {threshold:.1f}"


def test_every_decoder_hands_the_verifier_host_tensors_and_its_own_generator(on_host, monkeypatch):
    """The single-sequence tree decoder and the batch decoder: host inputs, and the host generator."""
    seen = []
    real = get_verifier("gbv")

    def recording(tokens, q, p, rng):
        seen.append((tokens.device.type, q.device.type, p.device.type, rng))
        return real(tokens, q, p, rng)

    monkeypatch.setattr(engine_decoder, "get_verifier", lambda name: recording)
    target, draft = hf_pair("llama", vocab=32, seed=1)
    dec = engine_decoder.make_decoder(target, draft, "gbv", 3, 3, 32, SamplingConfig(1.0), SamplingConfig(1.0), 5,
                                      target.device)
    with torch.inference_mode():  # (as generate runs it: off the CPU the torch forward's outputs would track grads)
        dec.prefill([1, 2, 3])
        for _ in range(3):
            dec.step()
    assert len(seen) == 3 and dec.verify_rng is not dec.rng
    assert all(s[:3] == ("cpu",) * 3 and s[3] is dec.verify_rng for s in seen)

    seen.clear()
    batch = BatchTreeDecoder(target, draft, 32, target.device, max_rows=2)
    rows = [batch.add_row([1, 2, 3], "gbv", 3, 3, SamplingConfig(1.0), SamplingConfig(1.0), seed) for seed in (1, 2)]
    with torch.inference_mode():
        batch.step({id(row): 3 for row in rows})
    assert len(seen) == 2 and all(row.verify_rng is not None and row.verify_rng is not row.rng for row in rows)
    assert {id(s[3]) for s in seen} == {id(row.verify_rng) for row in rows}


def test_batch_row_law_with_the_verifier_on_a_host_generator(on_host):
    """test_batch's law of one ``auto`` row among rows of other prompts, lengths and methods, with every
    row's verifier on its host generator and all rows' inputs copied in one read (the batch path)."""
    import test_batch

    test_batch.test_row_law_in_a_batch_of_mixed_prompts_lengths_and_methods(sharp_llama_pair())
