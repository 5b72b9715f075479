"""Validation of OpenAI-style request bodies, the caps, and OpenAI-style errors.

Plain validation (no pydantic models) so that every bad field gets one clear message naming the
field, answered with HTTP 400 and ``{"error": {"message", "type", "param", "code"}}``, the shape the
``openai`` client parses.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any

from gbv.engine.config import MAX_BLOCK_LEN, MAX_NUM_PATHS  # noqa: F401 - the engine's caps, re-exported

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_TEMPERATURE = 2.0  # as OpenAI's API


class ApiError(Exception):
    """An error answered as OpenAI does: ``status`` and the ``error`` object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> ApiError:
    """A 400 about ``param``."""
    return ApiError(400, message, param=param)


@dataclass
class Defaults:
    """Server-wide defaults (the command line) for fields a request leaves out."""

    method: str = "auto"
    num_paths: int = 3
    block_len: int = 8
    max_tokens: int = 128
    temperature: float = 1.0


@dataclass
class SamplingRequest:
    """A validated request, common to completions and chat. ``prompt`` is text, or ``prompt_ids``
    token ids (completions only), or ``messages`` (chat only; turned into a prompt by the app)."""

    model: str | None
    prompt: str | None
    prompt_ids: list[int] | None
    messages: list[dict[str, str]] | None
    stream: bool
    include_usage: bool
    temperature: float
    top_p: float
    max_tokens: int
    stop: list[str]
    seed: int
    method: str
    num_paths: int
    block_len: int
    ignore_eos: bool


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _int_field(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad(name, f"'{name}' must be an integer, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        where = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad(name, f"'{name}' must be {where}, got {value}")
    return value


def _float_field(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise bad(name, f"'{name}' must be a number, got {type(value).__name__} {value!r}")
    if value > high or value < low or (low_open and value == low):
        where = f"in ({low}, {high}]" if low_open else f"in [{low}, {high}]"
        raise bad(name, f"'{name}' must be {where}, got {value}")
    return float(value)


def _bool_field(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"'{name}' must be true or false, got {type(value).__name__} {value!r}")
    return value


def _unsupported(body: dict) -> None:
    """Reject fields that would change the output law (we would silently ignore them otherwise)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and value != 0:
            raise bad(name, f"'{name}' is not supported (it would change the target's law); leave it out or 0")
    if body.get("logit_bias"):
        raise bad("logit_bias", "'logit_bias' is not supported; leave it out")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "response_format"):
        value = body.get(name)
        if value not in (None, False, 0, [], {}):
            raise bad(name, f"'{name}' is not supported by gbv serve; leave it out")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad("best_of", "'best_of' must be 1 (one sample per request)")


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad("stop", "'stop' must be a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise bad("stop", f"'stop' holds at most {MAX_STOP_STRINGS} strings, got {len(value)}")
    return [s for s in value if s]


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    value = body.get("prompt")
    if value is None:
        raise bad("prompt", "'prompt' is required (a string, or a list of token ids)")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if not value:
            raise bad("prompt", "'prompt' is empty")
        return value, None
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return None, list(value)
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise bad("prompt", f"'prompt' holds {len(value)} prompts; send one prompt per request")
    raise bad("prompt", "'prompt' must be a non-empty string or a non-empty list of token ids")


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{index}].content", "only text content parts ({'type': 'text', 'text': ...}) "
                                                        "are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{index}].content", "'content' must be a string or a list of text parts")


def _messages(body: dict) -> list[dict[str, str]]:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise bad("messages", "'messages' must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}].role", f"messages[{i}].role must be system, developer, user, assistant or "
                                             f"tool, got {role!r}")
        out.append({"role": role, "content": _content_text(message.get("content"), i)})
    return out


def parse_request(body: Any, chat: bool, defaults: Defaults, methods: tuple[str, ...]) -> SamplingRequest:
    """Validate one request body (already JSON-decoded); raises :class:`ApiError` (400) on bad input."""
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "'model' must be a string")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad("n", f"'n' must be 1 (one sample per request), got {n!r}")
    _unsupported(body)
    if chat:
        prompt, prompt_ids, messages = None, None, _messages(body)
    else:
        (prompt, prompt_ids), messages = _prompt(body), None
    stream = _bool_field(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", "'stream_options' must be an object such as {'include_usage': true}")
    include_usage = _bool_field(options or {}, "include_usage", False)
    method = body.get("method", defaults.method)
    if method is None:
        method = defaults.method
    if not isinstance(method, str) or method not in methods:
        raise bad("method", f"unknown method {method!r}; choose one of: {', '.join(methods)}")
    max_tokens_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < 2**63):
        raise bad("seed", f"'seed' must be an integer in [0, 2**63), got {type(seed).__name__} {seed!r}")
    return SamplingRequest(
        model=model, prompt=prompt, prompt_ids=prompt_ids, messages=messages, stream=stream,
        include_usage=include_usage,
        temperature=_float_field(body, "temperature", defaults.temperature, 0.0, MAX_TEMPERATURE),
        top_p=_float_field(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        max_tokens=_int_field(body, max_tokens_name, defaults.max_tokens, 1),
        stop=_stop(body),
        # No seed: a fresh one, so that repeated sampled requests differ (as OpenAI's API does).
        seed=seed if seed is not None else secrets.randbits(63),
        method=method,
        num_paths=_int_field(body, "num_paths", defaults.num_paths, 1, MAX_NUM_PATHS),
        block_len=_int_field(body, "block_len", defaults.block_len, 1, MAX_BLOCK_LEN),
        ignore_eos=_bool_field(body, "ignore_eos", False),
    )
