"""Logits processing equals transformers' warpers; cache replicate / select / crop equal fresh forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from gbv.engine import cache as kv
from gbv.engine.sampling import SamplingConfig, process_logits, sample

from engine_toy import ARCHITECTURES, hf_pair


def hf_probs(logits, temperature, top_k, top_p):
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(None, logits.clone()).softmax(-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.3, 0, 1.0), (1.7, 5, 1.0), (1.0, 0, 0.8), (0.7, 10, 0.9), (1.0, 1, 1.0), (2.0, 0, 0.05),
    (1.0, 100, 1.0),
])
def test_matches_hf_warpers(temperature, top_k, top_p):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :5] = logits[0, 5]  # ties
    ours = process_logits(logits, SamplingConfig(temperature, top_k, top_p))
    torch.testing.assert_close(ours, hf_probs(logits, temperature, top_k, top_p), atol=1e-7, rtol=1e-6)
    assert torch.allclose(ours.sum(-1), torch.ones(6))
    # Works on (K, L, V) too.
    torch.testing.assert_close(process_logits(logits.reshape(2, 3, 50), SamplingConfig(temperature, top_k, top_p)),
                               ours.reshape(2, 3, 50))


def test_temperature_zero_is_one_hot_argmax_without_nan():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [-1e4, -5.0, -7.0, -6.0]])
    probs = process_logits(logits, SamplingConfig(0.0))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]))
    assert torch.equal(sample(probs, None, greedy=True), torch.tensor([1, 1]))


def test_sample_draws_from_probs():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.1, 0.0, 0.9]]).expand(20000, -1)
    draws = sample(probs, gen)
    assert (draws == 1).sum() == 0
    assert abs((draws == 2).float().mean().item() - 0.9) < 0.01


def test_inverse_cdf_never_draws_a_zero_mass_token():
    """Zeros first, between and last (where ``u * total`` rounding up would land), unnormalised rows
    and a one-hot row: the draws follow ``probs / total`` and never hit a token of mass 0."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 3.0]])
    draws = sample(rows.repeat(50000, 1), gen).reshape(50000, 2)
    counts = torch.bincount(draws[:, 0], minlength=6).double() / 50000
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts[[1, 3, 4]], torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64), atol=0.01)
    assert torch.all(draws[:, 1] == 5)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_replicate_select_crop(arch):
    """Prefill, replicate to 3 rows, feed a different continuation per row, keep row 1, crop: the
    cache then equals a fresh forward of the kept prefix."""
    target, _ = hf_pair(arch, vocab=32)
    ids = lambda rows: torch.tensor(rows, device=target.device)  # noqa: E731  (GBV_TEST_DEVICE)
    prompt = [1, 2, 3, 4, 5]
    cache = kv.new_cache(target)
    with torch.no_grad():
        target(input_ids=ids([prompt]), **{kv.cache_keyword(target): cache}, use_cache=True)
        kv.replicate(cache, 3)
        rows = ids([[6, 7, 8], [9, 10, 11], [12, 13, 14]])
        batched = target(input_ids=rows, **{kv.cache_keyword(target): cache}, use_cache=True).logits
        assert kv.cache_length(cache) == 8
        for k in range(3):
            fresh = target(input_ids=ids([prompt + rows[k].tolist()])).logits[0, -3:]
            torch.testing.assert_close(batched[k], fresh, atol=1e-4, rtol=0)
        kv.select_row(cache, 1)
        kv.crop(cache, 6)  # prompt + 9
        nxt = target(input_ids=ids([[20]]), **{kv.cache_keyword(target): cache}, use_cache=True).logits[0, -1]
        fresh = target(input_ids=ids([prompt + [9, 20]])).logits[0, -1]
        torch.testing.assert_close(nxt, fresh, atol=1e-4, rtol=0)
        assert kv.cache_length(cache) == 7
        kv.crop(cache, 10)  # longer than the cache: no-op
        assert kv.cache_length(cache) == 7


def test_api_fallback_layers():
    """Non-plain layers go through the cache API (batch_repeat_interleave / batch_select_indices / crop)."""
    from transformers.cache_utils import DynamicLayer

    class OtherLayer(DynamicLayer):
        pass

    target, _ = hf_pair("llama", vocab=32)
    ids = lambda rows: torch.tensor(rows, device=target.device)  # noqa: E731  (GBV_TEST_DEVICE)
    cache = kv.new_cache(target)
    cache.layers = [OtherLayer() for _ in cache.layers]
    prompt = [1, 2, 3, 4]
    with torch.no_grad():
        target(input_ids=ids([prompt]), **{kv.cache_keyword(target): cache}, use_cache=True)
        kv.replicate(cache, 2)
        target(input_ids=ids([[5, 6], [7, 8]]), **{kv.cache_keyword(target): cache}, use_cache=True)
        kv.select_row(cache, 1)
        kv.crop(cache, 5)
        assert cache.layers[0].keys.shape[0] == 1 and kv.cache_length(cache) == 5
        nxt = target(input_ids=ids([[9]]), **{kv.cache_keyword(target): cache}, use_cache=True).logits[0, -1]
        fresh = target(input_ids=ids([prompt + [7, 9]])).logits[0, -1]
    torch.testing.assert_close(nxt, fresh, atol=1e-4, rtol=0)


def test_the_engines_host_draws_take_the_verifiers_uniform_blocks():
    """TorchRandom.uniform / uniforms: the values of torch.rand blocks of ACCEPT_BLOCK from its
    generator, each once (the engine's host draws and the verifier's coins share them)."""
    from gbv.verify.common import ACCEPT_BLOCK, TorchRandom

    rng = TorchRandom(torch.Generator().manual_seed(9))
    taken = [rng.uniform() for _ in range(5)] + rng.uniforms(2 * ACCEPT_BLOCK).tolist() + [rng.accept(0.5)]
    reference = torch.Generator().manual_seed(9)
    blocks = [torch.rand(ACCEPT_BLOCK, generator=reference, dtype=torch.float64).tolist()[::-1] for _ in range(3)]
    expected = [value for block in blocks for value in block]
    assert taken[:-1] == expected[:len(taken) - 1]
    assert taken[-1] == (expected[len(taken) - 1] < 0.5)


def test_torchrandom_sample_on_the_host_draws_what_draw_rows_draws():
    """TorchRandom.sample's host form (two numpy calls) gives draw_rows' token for the same uniform:
    the next one of its block, fed to draw_rows_at. Normalised and unnormalised rows, zero masses
    (never drawn), tiny totals, a dominant token, V = 1, and uniforms forced to the ends of [0, 1)."""
    from gbv.verify.common import TorchRandom, draw_rows_at

    rng = TorchRandom(torch.Generator().manual_seed(4))
    values = np.random.default_rng(1)
    for trial in range(800):
        vocab = 4096 if trial % 9 == 0 else int(values.integers(1, 30))
        dist = torch.from_numpy(values.random(vocab).astype(np.float32))
        dist[torch.from_numpy(values.random(vocab) < 0.5)] = 0.0
        dist[int(values.integers(vocab))] += 1.0 if trial % 4 else 1e6
        if trial % 3 == 0:
            dist = dist / dist.sum()
        if trial % 5 == 0:
            dist = dist * 1e-30
        rng.uniform()  # (a block is drawn; the next uniform is its last value)
        if trial % 7 == 0:  # the ends of [0, 1), with the last token's mass 0 (drawn only past the total)
            rng._uniforms[-1] = [0.0, 1.0 - 2.0 ** -53][trial % 2]
            if vocab > 1:
                dist[-1] = 0.0
                dist[0] += float(dist.sum() == 0)
        u = rng._uniforms[-1]
        expected = int(draw_rows_at(dist[None], torch.tensor([[u]], dtype=torch.float64))[0])
        got = rng.sample(dist)
        assert got == expected, (trial, u, got, expected)
        assert float(dist[got]) > 0.0


def test_cache_keyword_follows_the_forward_signature():
    """transformers renamed ``past_key_values`` to ``cache``; a forward that only knows the old name
    would swallow ``cache=`` into ``**kwargs`` and decode without its cache, silently."""
    from gbv.engine.cache import cache_keyword

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=True, **kwargs):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=True, **kwargs):
            return input_ids

    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(New()) == "cache"
    target, _ = hf_pair("llama", vocab=32)
    assert cache_keyword(target) in ("cache", "past_key_values")
