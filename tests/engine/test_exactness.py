"""The whole engine is lossless: the law of the first 3 generated tokens equals the target's.

For each method, ``N`` (1500) generations with seeds ``0..N-1`` from a toy target/draft pair (vocabulary 6,
``TableLM``: context-dependent logits read back from a real transformers ``DynamicCache``, so the cache
surgery is exercised) are compared with the target's exact law of 3 tokens, enumerated from its processed
distributions over all 6^3 sequences. Pearson chi-square test, bins with expected count < 5 merged into
one, rejected at a false-alarm rate of 1e-3 per test. The seeds are fixed, so each test is
deterministic; a correct engine fails one given test with probability 1e-3 over the choice of seeds.
The negative controls hand the verifier a ``q`` other than the one sampled from and must be rejected.
The same check runs on a random HF Llama pair (vocabulary 4, 800 runs; slow).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2

import gbv.engine.decoder as engine_decoder
from gbv.engine.generate import generate
from gbv.engine.sampling import SamplingConfig, process_logits
from gbv.models.loading import ModelPair
from gbv.verify import METHODS, get_verifier

from engine_toy import hf_pair, table_pair

ALPHA = 1e-3
RUNS = 1500
PROMPT = [1, 2]
NEW = 3


def exact_law(model, sampling: SamplingConfig, vocab: int) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3 | PROMPT) under the target's processed distributions, for all vocab^3 sequences."""
    pairs = torch.tensor(list(itertools.product(range(vocab), repeat=2)))
    inputs = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)
    inputs = inputs.to(next(model.parameters(), torch.empty(0)).device)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits[:, -NEW:, :vocab]
    probs = process_logits(logits, sampling).double().cpu()  # (V^2, 3, V)
    law = {}
    for row, (a, b) in enumerate(pairs.tolist()):
        for c in range(vocab):
            law[(a, b, c)] = float(probs[row, 0, a] * probs[row, 1, b] * probs[row, 2, c])
    return law


def chi_square(counts: dict, law: dict, runs: int) -> tuple[float, float]:
    """(statistic, rejection threshold at ALPHA)."""
    stat, df = 0.0, -1
    merged_obs = merged_exp = 0.0
    for seq, prob in law.items():
        expected = prob * runs
        if expected < 5:
            merged_obs += counts.get(seq, 0)
            merged_exp += expected
            continue
        stat += (counts.get(seq, 0) - expected) ** 2 / expected
        df += 1
    if merged_exp > 0:
        stat += (merged_obs - merged_exp) ** 2 / merged_exp
        df += 1
    return stat, float(chi2.ppf(1 - ALPHA, df))


def run_law(pair, runs: int, **settings) -> dict:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(runs):
        out = generate(pair, prompt_ids=PROMPT, max_new_tokens=NEW, eos_token_id=[], seed=seed, **settings)
        seq = tuple(out.token_ids)
        assert len(seq) == NEW
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def check(pair, runs: int, temperature: float, top_k: int = 0, top_p: float = 1.0, **settings) -> tuple[float, float]:
    law = exact_law(pair.target, SamplingConfig(temperature, top_k, top_p), pair.target.config.vocab_size)
    counts = run_law(pair, runs, temperature=temperature, top_k=top_k, top_p=top_p, **settings)
    return chi_square(counts, law, runs)


@pytest.fixture(scope="module")
def toy_pair():
    target, draft = table_pair(vocab=6)
    return ModelPair(target, draft)


@pytest.mark.parametrize("method", ("ar", *METHODS))
def test_law_temperature_1(toy_pair, method):
    stat, threshold = check(toy_pair, RUNS, 1.0, method=method, num_paths=3, block_len=2)
    assert stat < threshold, f"{method}: chi2 {stat:.1f} >= {threshold:.1f}"


@pytest.mark.parametrize("method", METHODS)
def test_law_temperature_03(toy_pair, method):
    stat, threshold = check(toy_pair, RUNS, 0.3, method=method, num_paths=3, block_len=3)
    assert stat < threshold, f"{method}: chi2 {stat:.1f} >= {threshold:.1f}"


def test_law_top_k_top_p_and_draft_temperature(toy_pair):
    stat, threshold = check(toy_pair, RUNS, 0.8, top_k=4, top_p=0.9, draft_temperature=1.3, method="gbv",
                            num_paths=2, block_len=2)
    assert stat < threshold, f"chi2 {stat:.1f} >= {threshold:.1f}"


@pytest.mark.parametrize("method", ["token", pytest.param("gbv", marks=pytest.mark.slow)])
def test_negative_control_wrong_q_is_caught(toy_pair, monkeypatch, method):
    """Hand the verifier q at another temperature than the one the draft sampled from: the law breaks."""
    real = get_verifier(method)

    def wrong_q(tokens, q, p, rng):
        skewed = q ** 0.5  # q at twice the temperature
        return real(tokens, skewed / skewed.sum(-1, keepdim=True), p, rng)

    monkeypatch.setattr(engine_decoder, "get_verifier", lambda name: wrong_q)
    stat, threshold = check(toy_pair, RUNS, 1.0, method=method, num_paths=3, block_len=2)
    assert stat > threshold, f"broken engine not detected: chi2 {stat:.1f} < {threshold:.1f}"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["block", "gbv"])
def test_law_hf_llama(method):
    target, draft = hf_pair("llama", vocab=4, seed=3)
    with torch.no_grad():  # sharpen the random models so that the law is far from uniform
        for model, scale in ((target, 40.0), (draft, 25.0)):
            model.lm_head.weight.mul_(scale)
    stat, threshold = check(ModelPair(target, draft), 800, 1.0, method=method, num_paths=3, block_len=2)
    assert stat < threshold, f"{method}: chi2 {stat:.1f} >= {threshold:.1f}"
