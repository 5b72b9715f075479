"""Chat prompts (template and transcript fallback) and request parsing, without a server."""

import pytest

from gbv.serve.prompts import chat_prompt_ids, transcript
from gbv.serve.schemas import MAX_NUM_PATHS, ApiError, Defaults, parse_request

METHODS = ("ar", "gbv", "block")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from gbv.models.bundled import bundled_paths

    return AutoTokenizer.from_pretrained(str(bundled_paths()[0]), local_files_only=True)


def test_without_a_template_chat_is_a_role_content_transcript(tokenizer):
    assert not getattr(tokenizer, "chat_template", None)  # the bundled pair has none
    assert transcript(MESSAGES) == "system: Be brief.\nuser: Hi\nassistant:"
    assert chat_prompt_ids(tokenizer, MESSAGES) == tokenizer(transcript(MESSAGES))["input_ids"]


def test_a_chat_template_is_used_when_there_is_one(tokenizer):
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    try:
        ids = chat_prompt_ids(tokenizer, MESSAGES)
        expected = tokenizer("<system>Be brief.\n<user>Hi\n<assistant>", add_special_tokens=False)["input_ids"]
        assert ids == expected
    finally:
        tokenizer.chat_template = None


def test_defaults_fill_missing_fields_and_extras_override_them():
    defaults = Defaults(method="block", num_paths=2, block_len=4, max_tokens=7, temperature=1.0)
    req = parse_request({"prompt": "x"}, chat=False, defaults=defaults, methods=METHODS)
    assert (req.method, req.num_paths, req.block_len, req.max_tokens, req.temperature) == ("block", 2, 4, 7, 1.0)
    assert req.stream is False and req.stop == [] and 0 <= req.seed < 2**63
    req = parse_request({"prompt": [5, 6], "method": "gbv", "num_paths": MAX_NUM_PATHS, "block_len": 3, "seed": 9,
                         "stop": "\n", "user": "ignored", "presence_penalty": 0}, chat=False, defaults=defaults,
                        methods=METHODS)
    assert (req.prompt_ids, req.method, req.num_paths, req.block_len, req.seed, req.stop) == (
        [5, 6], "gbv", MAX_NUM_PATHS, 3, 9, ["\n"])
    chat = parse_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}],
                          "max_completion_tokens": 3}, chat=True, defaults=defaults, methods=METHODS)
    assert chat.messages == [{"role": "user", "content": "ab"}] and chat.max_tokens == 3


def test_a_method_the_pair_cannot_run_is_rejected():
    with pytest.raises(ApiError) as info:
        parse_request({"prompt": "x", "method": "gbv"}, chat=False, defaults=Defaults(method="ar"), methods=("ar",))
    assert info.value.status == 400 and info.value.param == "method"
