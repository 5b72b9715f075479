"""The public API around the loop: GenerationConfig (caps, one place of validation), batches of
prompts, prompt_ids shapes, the context_limit stop, incremental detokenisation."""

from __future__ import annotations

import logging

import pytest
import torch

from gbv.engine.config import MAX_BLOCK_LEN, MAX_NUM_PATHS, GenerationConfig
from gbv.engine.detokenize import IncrementalText
from gbv.engine.generate import generate, stream_generate
from gbv.errors import GbvError
from gbv.models.loading import ModelPair

from engine_toy import char_tokenizer, hf_pair

PROMPT = [1, 2, 3, 4]
FAST = dict(method="gbv", num_paths=2, block_len=3, max_new_tokens=8, eos_token_id=[])


@pytest.fixture(scope="module")
def pair():
    target, draft = hf_pair("llama", vocab=32, seed=3)
    return ModelPair(target, draft, tokenizer=char_tokenizer())


# ----------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("field, value, allowed", [
    ("num_paths", MAX_NUM_PATHS + 1, f"from 1 to {MAX_NUM_PATHS}"),
    ("num_paths", 100_000, f"from 1 to {MAX_NUM_PATHS}"),
    ("block_len", MAX_BLOCK_LEN + 1, f"from 1 to {MAX_BLOCK_LEN}"),
    ("num_paths", True, "integer"),
    ("block_len", 2.0, "integer"),
    ("seed", "0", "integer"),
    ("eos_token_id", "2", "token id"),
    ("stop_strings", [1], "strings"),
    ("temperature", float("nan"), ">= 0"),
])
def test_config_rejects_with_the_allowed_range(field, value, allowed):
    with pytest.raises(GbvError, match=allowed) as exc:
        GenerationConfig(**{field: value})
    assert exc.value.field == field and "\n" not in str(exc.value)


def test_config_is_frozen_normalised_and_used_by_generate(pair):
    # A fixed method: auto's arms depend on timing, so only its law (not its tokens) is fixed by the seed.
    config = GenerationConfig(method="gbv", max_new_tokens=8, eos_token_id=[], stop_strings="x", seed=5)
    assert config.eos_token_id == () and config.stop_strings == ("x",)
    with pytest.raises(AttributeError):
        config.seed = 1  # type: ignore[misc]
    with pytest.raises(GbvError, match="num_paths"):
        config.replace(num_paths=0)
    by_config = generate(pair, prompt_ids=PROMPT, config=config.replace(stop_strings=()))
    by_keywords = generate(pair, prompt_ids=PROMPT, method="gbv", max_new_tokens=8, eos_token_id=[], seed=5)
    assert by_config.token_ids == by_keywords.token_ids
    # keywords override the config
    assert generate(pair, prompt_ids=PROMPT, config=config.replace(stop_strings=()), seed=6).token_ids \
        == generate(pair, prompt_ids=PROMPT, method="gbv", max_new_tokens=8, eos_token_id=[], seed=6).token_ids
    with pytest.raises(GbvError, match="unknown setting 'num_path'"):
        generate(pair, prompt_ids=PROMPT, num_path=3)
    assert "_emit" not in stream_generate.__code__.co_varnames


# ----------------------------------------------------------------------------------------------- batches

def test_batch_outputs_match_single_calls_with_seed_plus_index(pair):
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3]]
    outs = generate(pair, prompt_ids=prompts, seed=10, **FAST)
    assert isinstance(outs, list) and len(outs) == 3
    for i, (ids, out) in enumerate(zip(prompts, outs)):
        assert out.token_ids == generate(pair, prompt_ids=ids, seed=10 + i, **FAST).token_ids
    assert outs[0].token_ids != outs[2].token_ids  # a repeated prompt is sampled afresh
    # Prompt 0's output does not depend on its neighbours.
    other = generate(pair, prompt_ids=[[1, 2, 3], [9, 9, 9, 9]], seed=10, **FAST)
    assert other[0].token_ids == outs[0].token_ids


def test_text_batch_and_2d_tensor(pair):
    outs = generate(pair, prompts=["the cat", "a dog"], seed=1, **FAST)
    assert [o.text for o in outs] == [generate(pair, prompt=p, seed=1 + i, **FAST).text
                                      for i, p in enumerate(["the cat", "a dog"])]
    rows = generate(pair, prompt_ids=torch.tensor([PROMPT, PROMPT]), seed=2, **FAST)
    assert len(rows) == 2 and rows[0].token_ids == generate(pair, prompt_ids=PROMPT, seed=2, **FAST).token_ids
    one_row = generate(pair, prompt_ids=torch.tensor([PROMPT]), seed=2, **FAST)
    assert isinstance(one_row, list) and len(one_row) == 1  # a 2D tensor is always a batch
    single = generate(pair, prompt_ids=torch.tensor(PROMPT), seed=2, **FAST)
    assert not isinstance(single, list) and single.token_ids == rows[0].token_ids


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_ids=[[1, 2], 3]), "mixes token ids and lists"),
    (dict(prompt_ids=[1, [2, 3]]), "integer token ids only"),
    (dict(prompt_ids=[[[1, 2]], [[3]]]), r"prompt_ids\[0\] must hold integer token ids only"),
    (dict(prompt_ids=[[1, 2], []]), r"prompt_ids\[1\] is empty"),
    (dict(prompt_ids=[1.5, 2]), "integer token ids only"),
    (dict(prompt_ids=torch.zeros(2, 2, 2, dtype=torch.long)), "1D integer tensor"),
    (dict(prompt_ids=torch.tensor([1.0, 2.0])), "1D integer tensor"),
    (dict(prompt_ids=torch.zeros(0, 3, dtype=torch.long)), "empty batch"),
    (dict(prompt_ids="123"), "list of token ids"),
    (dict(prompts="one text"), "list of strings"),
    (dict(prompts=[]), "prompts is empty"),
    (dict(prompts=["ok", 3]), r"prompts\[1\] must be a string"),
    (dict(prompt="x", prompt_ids=[1]), "exactly one"),
    (dict(prompts=["a", "b"], stream=print), "one prompt"),
])
def test_malformed_prompts_raise_gbv_error(pair, kwargs, match):
    with pytest.raises(GbvError, match=match):
        generate(pair, max_new_tokens=2, **kwargs)


def test_stream_generate_takes_one_prompt(pair):
    with pytest.raises(GbvError, match="one prompt"):
        stream_generate(pair, prompt_ids=[[1, 2], [3]])


# ----------------------------------------------------------------------------------------------- context

def test_context_limit_is_a_visible_stop_reason(caplog):
    target, draft = hf_pair("llama", vocab=32, seed=8)
    for model in (target, draft):
        model.config.max_position_embeddings = 16
    small = ModelPair(target, draft)
    with caplog.at_level(logging.WARNING, logger="gbv"):
        out = generate(small, prompt_ids=list(range(10)), method="gbv", block_len=4, max_new_tokens=50,
                       eos_token_id=[])
    assert len(out.token_ids) == 6 and out.stats.stop_reason == "context_limit"
    warnings = [r for r in caplog.records if r.name == "gbv"]
    assert len(warnings) == 1 and "max_new_tokens=50 was cut to 6" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gbv"):
        exact = generate(small, prompt_ids=list(range(10)), method="gbv", max_new_tokens=6, eos_token_id=[])
    assert exact.stats.stop_reason == "max_new_tokens" and not caplog.records


def test_cli_prints_one_warning_line_for_the_context_cut(capsys, tmp_path):
    from gbv.cli import main

    from engine_toy import save_pair

    target, draft = save_pair(tmp_path, max_positions=24)
    capsys.readouterr()
    rc = main(["generate", "hello", "--target", target, "--draft", draft, "--max-new-tokens", "100",
               "--temperature", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 0 and len(err) == 2, err
    assert err[0].startswith("gbv: warning: max_new_tokens=100 was cut to") and "stop: context_limit" in err[1]


# ----------------------------------------------------------------------------------------------- text

class _CountingTokenizer:
    """A wrapper that counts how many tokens ``decode`` is asked to turn into text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_incremental_text_equals_full_decode_and_is_linear():
    from transformers import AutoTokenizer

    from gbv.models.bundled import BUNDLED_DIR

    tok = AutoTokenizer.from_pretrained(BUNDLED_DIR / "target")  # byte-level BPE: multi-byte characters
    text = "Natalia sold 48 clips — half as many in May: 24 ✓. Total = 72 ünits\n" * 6
    ids = tok(text, add_special_tokens=False)["input_ids"]
    counting = _CountingTokenizer(tok)
    inc = IncrementalText(counting)
    chunks = [inc.extend(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(chunks) == inc.text == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in c for c in chunks)
    assert counting.decoded <= 4 * len(ids)  # whole-output decoding would be ~len(ids)^2 / 6


def test_stop_strings_stay_exact_with_incremental_text(pair):
    base = generate(pair, prompt="the cat", method="block", block_len=4, max_new_tokens=40, seed=4, eos_token_id=[])
    for start in (3, 11, 20):
        stop = base.text[start:start + 2]
        chunks = []
        out = generate(pair, prompt="the cat", method="block", block_len=4, max_new_tokens=40, seed=4,
                       eos_token_id=[], stop_strings=[stop], stream=chunks.append)
        end = base.text.index(stop) + len(stop)
        assert out.text == base.text[:end] == "".join(chunks) and out.stats.stop_reason == "stop_string"
        assert stop not in pair.tokenizer.decode(out.token_ids[:-1])


def test_memory_estimate_refuses_before_allocating(pair, monkeypatch):
    import gbv.engine.generate as engine

    small = engine.memory_estimate(pair, GenerationConfig(num_paths=1, block_len=1), 32, 100)
    large = engine.memory_estimate(pair, GenerationConfig(num_paths=16, block_len=32), 32, 100)
    assert 0 < small < large
    monkeypatch.setattr(engine, "_available_memory", lambda device: small)
    generate(pair, prompt_ids=[1], num_paths=1, block_len=1, max_new_tokens=99, eos_token_id=[])
    with pytest.raises(GbvError, match="GiB are free"):
        generate(pair, prompt_ids=[1], num_paths=16, block_len=32, max_new_tokens=99, eos_token_id=[])
