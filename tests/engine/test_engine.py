"""The decoding loop on random HF models: greedy equality, determinism, cache consistency,
architectures, stopping, streaming, validation."""

from __future__ import annotations

import pytest
import torch

import gbv
import gbv.engine.generate as engine
from gbv.engine.cache import cache_keyword
from gbv.engine.decoder import engine_for
from gbv.engine.generate import Generation, all_methods, generate, shared_vocab
from gbv.engine.tree_decoder import TreeDecoder, lean_model
from gbv.errors import GbvError
from gbv.models.loading import ModelPair, check_tokenizers

from engine_toy import ARCHITECTURES, LEAN, char_tokenizer, hf_pair, sharpen, table_pair

METHODS = all_methods()
PROMPT = [1, 2, 3, 4]


def greedy_reference(model, prompt, steps):
    """Plain greedy decoding, recomputing the whole sequence every step (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def llama_pair():
    target, draft = hf_pair("llama", vocab=32, seed=0)
    sharpen(target, draft)
    return ModelPair(target, draft)


@pytest.fixture(scope="module")
def text_pair():
    target, draft = hf_pair("llama", vocab=32, seed=1)
    return ModelPair(target, draft, tokenizer=char_tokenizer())


# ----------------------------------------------------------------------------------------------- greedy

@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_equals_target_argmax_every_method(arch):
    target, draft = hf_pair(arch, vocab=32, seed=2)
    sharpen(target, draft)
    pair = ModelPair(target, draft)
    expected = greedy_reference(target, PROMPT, 12)
    for method in METHODS:
        out = generate(pair, prompt_ids=PROMPT, method=method, num_paths=3, block_len=3, temperature=0.0,
                       max_new_tokens=12, eos_token_id=[])
        assert out.token_ids == expected, method
        assert out.stats.new_tokens == 12


def test_greedy_equals_hf_generate(llama_pair):
    prompt = torch.tensor([PROMPT], device=llama_pair.target.device)
    with torch.no_grad():
        hf = llama_pair.target.generate(prompt, do_sample=False, max_new_tokens=10, min_new_tokens=10,
                                        pad_token_id=0)[0, len(PROMPT):].tolist()
    for method in ("ar", "gbv", "block"):
        out = generate(llama_pair, prompt_ids=PROMPT, method=method, temperature=0, max_new_tokens=10,
                       block_len=4, eos_token_id=[])
        assert out.token_ids == hf, method


def test_greedy_with_sampling_draft(llama_pair):
    """Greedy target, sampling draft (draft_temperature 1): still the target's argmax."""
    expected = greedy_reference(llama_pair.target, PROMPT, 10)
    for method in ("token", "block", "gbv"):
        out = generate(llama_pair, prompt_ids=PROMPT, method=method, temperature=0, draft_temperature=1.0,
                       max_new_tokens=10, block_len=3, eos_token_id=[], seed=5)
        assert out.token_ids == expected, method


# ----------------------------------------------------------------------------------------------- seeds

def test_same_seed_same_tokens_different_seed_differs():
    target, draft = hf_pair("llama", vocab=32, seed=4)
    pair = ModelPair(target, draft)
    for method in [m for m in METHODS if m != "auto"]:  # auto: reproducible in law only (arms follow timing)
        runs = [generate(pair, prompt_ids=PROMPT, method=method, num_paths=2, block_len=3, max_new_tokens=16,
                         eos_token_id=[], seed=seed).token_ids for seed in (7, 7, 8)]
        assert runs[0] == runs[1], method
        assert runs[0] != runs[2], method


# ----------------------------------------------------------------------------------------------- caches

def _next_logits_fresh(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens], device=model.device)).logits[0, -1]


def _draft_next_logits_fresh(dec, draft, tokens):
    """The draft's next-token logits after a fresh prefill of ``tokens``: by the Hugging Face model, or,
    where the tree engine drafts with a view of bfloat16-rounded weights (``draft_lean_model``), by that
    view over a new cache (which must hold what the decoder's cache holds), after checking that view
    against the Hugging Face model to bfloat16's rounding."""
    fresh = _next_logits_fresh(draft, tokens)
    if isinstance(dec, TreeDecoder) and dec.draft is not lean_model(draft):
        with torch.inference_mode():
            rounded = dec.draft.chain(list(tokens), 0, dec.draft.plain_cache(1, len(tokens) + 8))[0, -1]
        torch.testing.assert_close(rounded, fresh, atol=0.05, rtol=0.05)
        return rounded
    return fresh


def _cached_next_logits(dec, which: str, tokens: list[int]) -> torch.Tensor:
    """Next-token logits after ``tokens`` from the decoder's cache of ``which`` model, feeding only
    the tokens that cache has not seen (the pending one; for the draft, from ``draft_len`` on)."""
    start = len(tokens) - 1 if which == "target" else dec.draft_len
    with torch.inference_mode():  # the caches were made in inference mode
        if isinstance(dec, TreeDecoder):
            model, cache = (dec.target, dec.target_cache) if which == "target" else (dec.draft, dec.draft_cache)
            return dec._chain(model, cache, tokens[start:], start)
        model, cache = (dec.target, dec.target_cache) if which == "target" else (dec.draft, dec.draft_cache)
        assert cache.get_seq_length() == start
        return model(input_ids=torch.tensor([tokens[start:]], device=model.device), **{cache_keyword(model): cache},
                     use_cache=True).logits[0, -1]


def _check_caches_after_generation(monkeypatch, arch, method, settings, engine_kind):
    decoders = []
    real = engine.make_decoder

    def recording(*args, **kwargs):
        decoders.append(real(*args, **kwargs))
        return decoders[-1]

    monkeypatch.setattr(engine, "make_decoder", recording)
    target, draft = hf_pair(arch, vocab=32, seed=5)
    pair = ModelPair(target, draft)
    for max_new, temperature, eos in settings:
        out = generate(pair, prompt_ids=PROMPT, method=method, num_paths=3, block_len=4, temperature=temperature,
                       max_new_tokens=max_new, eos_token_id=eos, seed=max_new)
        dec = getattr(decoders[-1], "base", decoders[-1])  # auto wraps a base decoder
        assert isinstance(dec, TreeDecoder) == (engine_kind == "tree")
        tokens = dec.tokens
        assert tokens == PROMPT + out.token_ids
        torch.testing.assert_close(_cached_next_logits(dec, "target", tokens), _next_logits_fresh(target, tokens),
                                   atol=1e-4, rtol=0)
        if method != "ar":
            assert dec.draft_len < len(tokens)
            torch.testing.assert_close(_cached_next_logits(dec, "draft", tokens),
                                       _draft_next_logits_fresh(dec, draft, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_caches_equal_fresh_prefill(monkeypatch, method):
    # (max_new_tokens, temperature, eos): token limit, greedy, and stops on an EOS mid-block.
    _check_caches_after_generation(monkeypatch, "llama", method, [(17, 1.0, []), (9, 0.0, []), (23, 0.7, []),
                                                                  (40, 1.0, [3, 5, 7])], "tree")


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "llama"])
def test_caches_equal_fresh_prefill_architectures(monkeypatch, arch):
    kind = engine_for(*hf_pair(arch, vocab=32))
    assert kind == ("tree" if arch in LEAN else "hf")
    _check_caches_after_generation(monkeypatch, arch, "gbv", [(13, 1.0, []), (30, 1.0, [3, 5])], kind)


def test_plain_hf_path_on_llama(monkeypatch):
    """The plain Hugging Face path stays correct for the Llama family too (GBV_ENGINE=hf)."""
    monkeypatch.setenv("GBV_ENGINE", "hf")
    _check_caches_after_generation(monkeypatch, "llama", "gbv", [(13, 1.0, []), (30, 1.0, [3, 5])], "hf")


@pytest.mark.parametrize("method", ["block", "gbv"])
def test_each_committed_token_fed_once(monkeypatch, method):
    """Log (model, cache length before the call, positions fed) of every forward: the target always
    starts at the committed length (its cache is cropped and reused, never rebuilt), and the draft,
    at the start of each iteration, is fed exactly the committed tokens it has not seen, then one
    token per step."""
    target, draft = table_pair(vocab=6)
    log = []
    for name, model in (("target", target), ("draft", draft)):
        original = model.forward

        def logged(*args, _name=name, _original=original, **kwargs):
            log.append((_name, kwargs["cache"].get_seq_length(), kwargs["input_ids"].shape[1]))
            return _original(*args, **kwargs)

        monkeypatch.setattr(model, "forward", logged)
    prompt = [1, 2, 3]
    out = generate(ModelPair(target, draft), prompt_ids=prompt, method=method, block_len=3, max_new_tokens=40,
                   eos_token_id=[], seed=3)
    assert log[:2] == [("target", 0, 2), ("draft", 0, 2)]
    committed, draft_seen, accepted = len(prompt) - 1, len(prompt) - 1, iter(out.stats.accepted_lengths)
    drafts = []
    for name, start, fed in log[2:]:
        if name == "draft":
            if not drafts:
                assert start == draft_seen and start + fed == committed + 1
            else:
                assert fed == 1 and start == drafts[-1][0] + drafts[-1][1]
            drafts.append((start, fed))
            continue
        assert start == committed
        if drafts:
            block = len(drafts)
            assert fed == block + 1
            tau = next(accepted)
            committed += tau + 1
            draft_seen = min(committed, drafts[-1][0] + drafts[-1][1])
        else:
            assert fed == 1
            committed += 1
        drafts = []
    assert committed == len(prompt) + 40 - 1
    assert next(accepted, None) is None


# ----------------------------------------------------------------------------------------------- architectures

@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_architecture_every_method_samples(arch):
    target, draft = hf_pair(arch, vocab=32, seed=6)
    pair = ModelPair(target, draft)
    for method in METHODS:
        out = generate(pair, prompt_ids=PROMPT, method=method, num_paths=3, block_len=3, max_new_tokens=10,
                       eos_token_id=[], seed=1)
        assert len(out.token_ids) == 10 and all(0 <= t < 32 for t in out.token_ids)
        stats = out.stats
        assert stats.new_tokens == 10 and stats.target_calls >= 1
        assert stats.block_efficiency == pytest.approx(10 / stats.target_calls)
        if method == "ar":
            assert stats.target_calls == 10 and stats.draft_steps == 0
        else:  # auto: sized to its longest arm
            assert len(stats.depth_accept_counts) == (3 if method != "auto" else stats.block_len)
            assert stats.depth_accept_counts[0] == sum(a >= 1 for a in stats.accepted_lengths)


# ----------------------------------------------------------------------------------------------- vocab widths

def test_padded_vocabularies_are_cut():
    target, _ = hf_pair("qwen2", vocab=40, seed=7)
    _, draft = hf_pair("qwen2", vocab=32, seed=7)
    tokenizer = char_tokenizer()  # 32 tokens
    assert shared_vocab(target, draft, tokenizer) == 32
    assert shared_vocab(target, draft, None) == 32
    pair = ModelPair(target, draft, tokenizer=tokenizer)
    out = generate(pair, prompt="hello", method="gbv", num_paths=2, block_len=3, max_new_tokens=12, seed=0)
    assert all(t < 32 for t in out.token_ids)
    _, small_draft = hf_pair("qwen2", vocab=24, seed=7)
    with pytest.raises(GbvError, match="incompatible"):
        shared_vocab(target, small_draft, tokenizer)


def test_different_tokenizers_rejected():
    other = char_tokenizer()
    other.add_tokens(["xyz"])
    with pytest.raises(GbvError, match="tokenizers differ"):
        check_tokenizers(char_tokenizer(), other)
    check_tokenizers(char_tokenizer(), char_tokenizer())


# ----------------------------------------------------------------------------------------------- stopping

def test_eos_stops_and_truncates(llama_pair):
    base = generate(llama_pair, prompt_ids=PROMPT, method="gbv", block_len=4, max_new_tokens=24, eos_token_id=[],
                    seed=11).token_ids
    eos = base[6]
    out = generate(llama_pair, prompt_ids=PROMPT, method="gbv", block_len=4, max_new_tokens=24, eos_token_id=eos,
                   seed=11)
    assert out.token_ids == base[:base.index(eos) + 1]
    assert out.stats.stop_reason == "eos"


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_plain_decoding_stops_at_eos_inside_a_run(llama_pair, monkeypatch, temperature):
    """ar's steps run several to a call (on the host forward: a run ends at the generation's EOS itself): the
    tokens of a call per step (GBV_PLAIN_RUN = 1's form), cut after the EOS, and no target step past it."""
    from gbv.engine import static_sampling

    def run(eos, plain_run):
        monkeypatch.setattr(static_sampling, "PLAIN_RUN", plain_run)
        return generate(llama_pair, prompt_ids=PROMPT, method="ar", max_new_tokens=24, eos_token_id=eos,
                        temperature=temperature, seed=4)

    base = run([], 1)
    assert run([], 8).token_ids == base.token_ids
    eos = base.token_ids[9]
    cut = base.token_ids[:base.token_ids.index(eos) + 1]
    for plain_run in (8, 1):
        out = run([eos], plain_run)
        assert out.token_ids == cut and out.stats.stop_reason == "eos"
        assert out.stats.to_dict()["target_calls"] == len(cut)


def test_text_stop_strings_and_streaming(text_pair):
    out = generate(text_pair, prompt="the cat", method="gbv", num_paths=2, block_len=3, max_new_tokens=30,
                   seed=2, eos_token_id=[])
    assert out.text == text_pair.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    text = out.text
    stop = text[7:9]
    end = text.index(stop) + len(stop)
    chunks = []
    stopped = generate(text_pair, prompt="the cat", method="gbv", num_paths=2, block_len=3, max_new_tokens=30,
                       seed=2, eos_token_id=[], stop_strings=[stop], stream=chunks.append)
    assert stopped.text == text[:end]
    assert stopped.stats.stop_reason == "stop_string"
    assert stopped.token_ids == out.token_ids[:len(stopped.token_ids)]
    assert stop in text_pair.tokenizer.decode(stopped.token_ids)
    assert stop not in text_pair.tokenizer.decode(stopped.token_ids[:-1])
    assert "".join(chunks) == stopped.text


def test_default_eos_from_tokenizer(text_pair):
    eos = text_pair.tokenizer.eos_token_id
    for seed in range(12):
        out = generate(text_pair, prompt="ab", method="block", block_len=3, max_new_tokens=40, seed=seed)
        assert eos not in out.token_ids[:-1]
        if out.token_ids[-1] == eos:
            assert out.stats.stop_reason == "eos"


def test_iterator_form_and_token_stream(llama_pair):
    gen = Generation(llama_pair, prompt_ids=PROMPT, method="spectr", block_len=3, max_new_tokens=15, eos_token_id=[],
                     seed=4)
    chunks = list(gen)
    assert gen.output is not None
    assert [t for chunk in chunks for t in chunk] == gen.output.token_ids
    assert gen.output.text is None
    direct = generate(llama_pair, prompt_ids=torch.tensor(PROMPT), method="spectr", block_len=3, max_new_tokens=15,
                      eos_token_id=[], seed=4)
    assert direct.token_ids == gen.output.token_ids


def test_stats_dict_and_lazy_export(llama_pair):
    out = gbv.generate(llama_pair, prompt_ids=PROMPT, method="gbv", num_paths=3, block_len=4, max_new_tokens=20,
                       eos_token_id=[])
    stats = out.to_dict()["stats"]
    for key in ("method", "num_paths", "block_len", "new_tokens", "target_calls", "draft_steps", "block_efficiency",
                "accepted_lengths", "depth_accept_counts", "time_draft", "time_target", "time_verify", "time_other",
                "time_total", "tokens_per_second"):
        assert key in stats
    assert stats["num_paths"] == 3 and stats["block_len"] == 4 and stats["new_tokens"] == 20
    single = gbv.generate(llama_pair, prompt_ids=PROMPT, method="token", num_paths=3, max_new_tokens=5,
                          eos_token_id=[])
    assert single.stats.num_paths == 1


def test_context_limit_clamps_and_prompt_too_long():
    target, draft = hf_pair("llama", vocab=32, seed=8)
    for model in (target, draft):
        model.config.max_position_embeddings = 16
    pair = ModelPair(target, draft)
    out = generate(pair, prompt_ids=list(range(10)), method="gbv", block_len=8, max_new_tokens=50, eos_token_id=[])
    assert len(out.token_ids) == 6  # clamped to the context: 10 + 6 = 16 positions
    with pytest.raises(GbvError, match="context"):
        generate(pair, prompt_ids=list(range(16)), method="gbv", max_new_tokens=1)


# ----------------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_ids=[]), "empty"),
    (dict(prompt=""), "empty"),
    (dict(prompt="x"), "tokenizer"),
    (dict(), "exactly one"),
    (dict(prompt_ids=[1], num_paths=0), "num_paths"),
    (dict(prompt_ids=[1], block_len=0), "block_len"),
    (dict(prompt_ids=[1], temperature=-0.5), "temperature"),
    (dict(prompt_ids=[1], draft_temperature=-1), "draft_temperature"),
    (dict(prompt_ids=[1], top_p=0.0), "top_p"),
    (dict(prompt_ids=[1], top_p=1.5), "top_p"),
    (dict(prompt_ids=[1], top_k=-1), "top_k"),
    (dict(prompt_ids=[1], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_ids=[1], method="nope"), "unknown method"),
    (dict(prompt_ids=[99]), r"\[0, 32\)"),
    (dict(prompt_ids=[1], stop_strings=["x"]), "tokenizer"),
])
def test_bad_inputs_raise_gbv_error(llama_pair, kwargs, match):
    with pytest.raises(GbvError, match=match):
        generate(llama_pair, **kwargs)


def test_method_needing_draft_without_one(llama_pair):
    target_only = ModelPair(llama_pair.target)
    assert generate(target_only, prompt_ids=PROMPT, method="ar", max_new_tokens=3, eos_token_id=[]).stats.new_tokens == 3
    with pytest.raises(GbvError, match="draft"):
        generate(target_only, prompt_ids=PROMPT, method="gbv")


def test_single_token_prompt_no_prefill(llama_pair):
    expected = greedy_reference(llama_pair.target, [5], 8)
    for method in METHODS:
        out = generate(llama_pair, prompt_ids=[5], method=method, temperature=0, max_new_tokens=8, block_len=3,
                       eos_token_id=[])
        assert out.token_ids == expected, method
        sampled = generate(llama_pair, prompt_ids=[5], method=method, max_new_tokens=8, block_len=3, eos_token_id=[])
        assert len(sampled.token_ids) == 8


def test_iterator_validates_eagerly_and_leaves_grad_mode(llama_pair):
    with pytest.raises(GbvError):
        engine.stream_generate(llama_pair, prompt_ids=[], method="gbv")
    modes = []
    for _ in Generation(llama_pair, prompt_ids=PROMPT, method="gbv", max_new_tokens=6, block_len=2, eos_token_id=[]):
        modes.append(torch.is_inference_mode_enabled())
    assert modes and not any(modes)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_equal_to_target_accepts_everything(temperature):
    """With the target as its own draft (p = q up to float round-off) every block is accepted: for
    every method with one path, and greedy with two. (With K > 1 at temperature > 0 a multi-path
    verifier may reject even when p = q: GBV runs BV against the law of the *selected* path.)"""
    target, _ = hf_pair("llama", vocab=32, seed=9)
    pair = ModelPair(target, target)
    for method in [m for m in METHODS if m not in ("ar", "auto")]:  # auto picks its own K and L
        out = generate(pair, prompt_ids=PROMPT, method=method, num_paths=1 if temperature else 2, block_len=3,
                       temperature=temperature,
                       max_new_tokens=12, eos_token_id=[], seed=0)
        assert out.stats.accepted_lengths == [3, 3, 3], method
        assert out.stats.block_efficiency == 4.0


def test_a_pair_off_the_lean_engine_is_told_why_once(monkeypatch, caplog):
    """A pair the lean engine does not run gets one warning saying so and why (it decodes slower), one
    line for both models (the same reason once); a lean pair gets none, and neither does a pair sent to
    the plain path on purpose."""
    import logging

    from gbv.engine.lean import lean_unsupported_reason

    bloom_target, bloom_draft = hf_pair("bloom", vocab=32)
    with caplog.at_level(logging.WARNING, logger="gbv"):
        for _ in range(2):
            generate(ModelPair(bloom_target, bloom_draft), prompt_ids=PROMPT, method="block", max_new_tokens=3,
                     eos_token_id=[])
    told = [r.getMessage() for r in caplog.records if "plain Hugging Face path" in r.getMessage()]
    assert told == ["this pair runs on the plain Hugging Face path (slower: no token tree, a cache row per "
                    f"path; docs/ENGINE.md, \"Two paths\"). BloomForCausalLM: {lean_unsupported_reason(bloom_target)}"]
    caplog.clear()
    llama_target, llama_draft = hf_pair("llama", vocab=32)
    with caplog.at_level(logging.WARNING, logger="gbv"):
        generate(ModelPair(llama_target, llama_draft), prompt_ids=PROMPT, method="block", max_new_tokens=3,
                 eos_token_id=[])
        monkeypatch.setenv("GBV_ENGINE", "hf")
        generate(ModelPair(llama_target, llama_draft), prompt_ids=PROMPT, method="block", max_new_tokens=3,
                 eos_token_id=[])
    assert not [r for r in caplog.records if "plain Hugging Face path" in r.getMessage()]
