"""``gbv.generate``: lossless speculative sampling with any verifier of :mod:`gbv.verify` (or plain ``ar``).

One iteration (docs/SPEC.md section 9; both caches hold every committed token but the *pending* one):

1. draft: the draft cache is replicated to K rows; each row is fed the tokens the draft has not seen
   (the pending token, plus the last drafted token when the previous iteration accepted all L) and then
   samples L tokens, one batched forward per step; the processed ``q`` each token was drawn from is
   kept (K, L, V). The draft never runs on its own last token: it is fed next iteration if accepted;
2. target: its cache is replicated to K rows and fed ``[pending, x_1..x_L]`` per row in one forward,
   giving ``p`` (K, L+1, V) after the same temperature / top-k / top-p processing;
3. verify: the method's verifier returns ``(path k*, tau, Y)``;
4. commit pending + ``x^{k*}_{1:tau}``; ``Y`` becomes pending; both caches keep row ``k*`` cropped to
   the committed length (views only; the next forward's concatenation copies once).

Where things live: logits processing and sampling in :mod:`gbv.engine.sampling`, cache surgery in
:mod:`gbv.engine.cache`, counters in :mod:`gbv.engine.stats`, the loop here.

Context length: the prompt must be shorter than the models' ``max_position_embeddings``;
``max_new_tokens`` is clamped so that prompt + new tokens fit, and near the end (of ``max_new_tokens`` or
of the context) the block is shortened, exactly as a fresh call with a smaller ``block_len`` would do
(every iteration is lossless for any L).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gbv.engine.auto import AUTO
from gbv.engine.decoder import AR, make_decoder
from gbv.engine.sampling import SamplingConfig
from gbv.engine.stats import GenerationStats
from gbv.errors import GbvError
from gbv.verify import METHODS


def all_methods() -> tuple[str, ...]:
    """Every method :func:`generate` accepts: ``ar``, ``auto`` (chooses per iteration), then the
    registered verifiers."""
    return (AR, AUTO, *METHODS)


@dataclass
class GenerationOutput:
    """``text`` is None when the pair has no tokenizer. ``token_ids`` are the new tokens only."""

    text: str | None
    token_ids: list[int]
    stats: GenerationStats

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": list(self.token_ids), "stats": self.stats.to_dict()}


# ----------------------------------------------------------------------------------------------- helpers

def _logit_width(model) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def shared_vocab(target, draft, tokenizer=None) -> int:
    """How many logits of each model are compared: equal widths are kept whole; different widths
    (padded vocabularies) are cut to the tokenizer's size, which must fit in both (else GbvError)."""
    width_t = _logit_width(target)
    if draft is None:
        return width_t
    width_d = _logit_width(draft)
    if width_t == width_d:
        return width_t
    smaller = min(width_t, width_d)
    if tokenizer is not None:
        n_tok = len(tokenizer)
        if n_tok > smaller:
            raise GbvError(f"target and draft vocabularies are incompatible: logits widths {width_t} and {width_d}, "
                           f"tokenizer has {n_tok} tokens")
        return n_tok
    return smaller


def _max_positions(*models) -> int | None:
    limits = []
    for model in models:
        if model is None:
            continue
        value = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if isinstance(value, int) and value > 0:
            limits.append(value)
    return min(limits) if limits else None


def _default_eos(pair) -> list[int]:
    candidates: list[Any] = []
    if pair.tokenizer is not None and getattr(pair.tokenizer, "eos_token_id", None) is not None:
        candidates.append(pair.tokenizer.eos_token_id)
    gen_config = getattr(pair.target, "generation_config", None)
    if not candidates and gen_config is not None and gen_config.eos_token_id is not None:
        candidates.append(gen_config.eos_token_id)
    if not candidates:
        value = getattr(pair.target.config, "eos_token_id", None)
        if value is not None:
            candidates.append(value)
    out: list[int] = []
    for value in candidates:
        out.extend([int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)])
    return out


def _eos_list(eos_token_id, pair) -> list[int]:
    if eos_token_id is None:
        return _default_eos(pair)
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return [int(v) for v in eos_token_id]


# ----------------------------------------------------------------------------------------------- API

def _validate(pair, prompt, prompt_ids, method, num_paths, block_len, temperature, draft_temperature, top_k,
              top_p, max_new_tokens) -> list[int]:
    if method not in all_methods():
        raise GbvError(f"unknown method {method!r}; choose one of: {', '.join(all_methods())}")
    if method not in (AR, AUTO) and pair.draft is None:
        raise GbvError(f"method {method!r} needs a draft model (load one, or use method 'ar')")
    if isinstance(num_paths, bool) or not isinstance(num_paths, int) or num_paths < 1:
        raise GbvError(f"num_paths must be an integer >= 1, got {num_paths!r}")
    if isinstance(block_len, bool) or not isinstance(block_len, int) or block_len < 1:
        raise GbvError(f"block_len must be an integer >= 1, got {block_len!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GbvError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    for name, value in (("temperature", temperature), ("draft_temperature", draft_temperature)):
        if value is not None and (not isinstance(value, (int, float)) or not value >= 0 or value == float("inf")):
            raise GbvError(f"{name} must be a number >= 0 (0 = greedy), got {value!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise GbvError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise GbvError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if (prompt is None) == (prompt_ids is None):
        raise GbvError("give exactly one of prompt (text) or prompt_ids (token ids)")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise GbvError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise GbvError("prompt is empty")
        if pair.tokenizer is None:
            raise GbvError("this model pair has no tokenizer: pass prompt_ids instead of prompt text")
        ids = pair.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not ids:
            raise GbvError("prompt encodes to no tokens")
    else:
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.reshape(-1).tolist()
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise GbvError("prompt_ids is empty")
    return ids


def stream_generate(pair, prompt: str | None = None, prompt_ids: Sequence[int] | torch.Tensor | None = None,
                    method: str = "gbv", num_paths: int = 3, block_len: int = 8, temperature: float = 1.0,
                    draft_temperature: float | None = None, top_k: int = 0, top_p: float = 1.0,
                    max_new_tokens: int = 128, eos_token_id: int | Sequence[int] | None = None,
                    stop_strings: str | Sequence[str] | None = None, seed: int = 0, _emit: bool = True,
                    ) -> Iterator[str | list[int]]:
    """Iterator form of :func:`generate`: validates now (GbvError), then returns an iterator that yields
    text chunks (token-id lists without a tokenizer) as they are committed and returns the
    :class:`GenerationOutput` (``StopIteration.value``; or use :class:`Generation`)."""
    ids = _validate(pair, prompt, prompt_ids, method, num_paths, block_len, temperature, draft_temperature,
                    top_k, top_p, max_new_tokens)
    draft = pair.draft if method != AR else None
    vocab = shared_vocab(pair.target, draft, pair.tokenizer)
    if max(ids) >= vocab or min(ids) < 0:
        raise GbvError(f"prompt token ids must be in [0, {vocab})")
    limit = _max_positions(pair.target, draft)
    if limit is not None:
        if len(ids) >= limit:
            raise GbvError(f"prompt has {len(ids)} tokens; the model context is {limit} positions")
        max_new_tokens = min(max_new_tokens, limit - len(ids))
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    stop_strings = [s for s in (stop_strings or []) if s]
    if stop_strings and pair.tokenizer is None:
        raise GbvError("stop_strings need a tokenizer; this model pair has none")
    eos = set(_eos_list(eos_token_id, pair))
    target_sampling = SamplingConfig(float(temperature), int(top_k), float(top_p))
    draft_sampling = SamplingConfig(float(temperature if draft_temperature is None else draft_temperature),
                                    int(top_k), float(top_p))

    return _run(pair, ids, method, num_paths, block_len, vocab, target_sampling, draft_sampling, seed, limit,
                max_new_tokens, eos, stop_strings, emit=_emit)


def _run(pair, ids, method, num_paths, block_len, vocab, target_sampling, draft_sampling, seed, limit,
         max_new_tokens, eos, stop_strings, emit: bool) -> Iterator[str | list[int]]:
    """The loop. Yields chunks when ``emit`` (then text is decoded every iteration); returns the output.
    Model work runs under ``torch.inference_mode`` but never across a ``yield`` (so the caller's code
    between chunks runs in its own mode), and time spent by the caller is not counted."""
    start = time.perf_counter()
    paused = 0.0
    tokenizer = pair.tokenizer
    draft = pair.draft if method != AR else None
    with torch.inference_mode():
        decoder = make_decoder(pair.target, draft, method, num_paths, block_len, vocab, target_sampling,
                          draft_sampling, seed, pair.device)
        decoder.prefill(ids)
    prompt_len = len(ids)
    stats = decoder.stats
    shown = 0  # characters (or tokens) already streamed
    text = None
    stop_reason = ""
    while not stop_reason:
        generated = len(decoder.tokens) - prompt_len
        remaining = max_new_tokens - generated
        room = (limit - len(decoder.tokens)) if limit is not None else remaining
        with torch.inference_mode():
            new = decoder.step(min(remaining - 1, room))
        # Stop conditions on the newly committed tokens.
        keep = len(new)
        for i, token in enumerate(new):
            if token in eos:
                keep, stop_reason = i + 1, "eos"
                break
        if generated + keep >= max_new_tokens:
            keep = min(keep, max_new_tokens - generated)
            stop_reason = stop_reason or "max_new_tokens"
        if keep < len(new):
            decoder.truncate(prompt_len + generated + keep)
        if tokenizer is None:
            if emit and len(decoder.tokens) - prompt_len > shown:
                chunk_ids = decoder.tokens[prompt_len + shown:]
                shown += len(chunk_ids)
                pause = time.perf_counter()
                yield chunk_ids
                paused += time.perf_counter() - pause
            continue
        if not (emit or stop_strings or stop_reason):
            continue
        out_ids = decoder.tokens[prompt_len:]
        text = tokenizer.decode(out_ids, skip_special_tokens=True)
        if stop_strings:
            hit = _first_stop(text, stop_strings)
            if hit is not None:
                decoder.truncate(prompt_len + _tokens_for_stop(tokenizer, out_ids, generated, stop_strings))
                text = text[:hit]
                stop_reason = "stop_string"
        if emit and (stop_reason or not text.endswith("\ufffd")) and len(text) > shown:
            chunk, shown = text[shown:], len(text)
            pause = time.perf_counter()
            yield chunk
            paused += time.perf_counter() - pause
    stats.stop_reason = stop_reason
    stats.new_tokens = len(decoder.tokens) - prompt_len
    stats.time_total = time.perf_counter() - start - paused
    return GenerationOutput(text=text, token_ids=decoder.tokens[prompt_len:], stats=stats)


def _first_stop(text: str, stop_strings: list[str]) -> int | None:
    """End index (exclusive) of the earliest stop string in ``text``, or None."""
    ends = [text.find(s) + len(s) for s in stop_strings if s in text]
    return min(ends) if ends else None


def _tokens_for_stop(tokenizer, ids: list[int], before: int, stop_strings: list[str]) -> int:
    """Fewest tokens (more than ``before``, where no stop string occurred) whose text contains a stop string."""
    for n in range(before + 1, len(ids) + 1):
        if _first_stop(tokenizer.decode(ids[:n], skip_special_tokens=True), stop_strings) is not None:
            return n
    return len(ids)


class Generation:
    """``for chunk in Generation(pair, prompt=...): ...`` then ``.output`` holds the GenerationOutput."""

    def __init__(self, pair, **kwargs: Any) -> None:
        self._iterator = stream_generate(pair, **kwargs)
        self.output: GenerationOutput | None = None

    def __iter__(self) -> Iterator[str | list[int]]:
        self.output = yield from self._iterator
        return self.output


def generate(pair, prompt: str | None = None, prompt_ids: Sequence[int] | torch.Tensor | None = None,
             method: str = "gbv", num_paths: int = 3, block_len: int = 8, temperature: float = 1.0,
             draft_temperature: float | None = None, top_k: int = 0, top_p: float = 1.0,
             max_new_tokens: int = 128, eos_token_id: int | Sequence[int] | None = None,
             stop_strings: str | Sequence[str] | None = None, seed: int = 0,
             stream: Callable[[str | list[int]], Any] | None = None) -> GenerationOutput:
    """Sample up to ``max_new_tokens`` tokens from ``pair.target`` (exactly its law), drafting with
    ``pair.draft`` and verifying with ``method`` (``ar`` = target only; or any of :data:`gbv.verify.METHODS`).

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 are off; the draft uses
    ``draft_temperature`` (default: ``temperature``) and the same top-k / top-p. ``eos_token_id``:
    None = the tokenizer's / generation config's, ``[]`` = none. Generation stops after an EOS token
    (kept), at ``max_new_tokens``, or when the text contains one of ``stop_strings`` (text and tokens
    are cut right after it). ``stream`` receives text chunks (token-id lists without a tokenizer) as
    they are committed. Same ``seed`` and settings -> the same tokens. Bad input raises GbvError.
    """
    iterator = stream_generate(pair, prompt=prompt, prompt_ids=prompt_ids, method=method, num_paths=num_paths,
                               block_len=block_len, temperature=temperature, draft_temperature=draft_temperature,
                               top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                               stop_strings=stop_strings, seed=seed, _emit=stream is not None)
    while True:
        try:
            chunk = next(iterator)
        except StopIteration as done:
            return done.value
        if stream is not None:
            stream(chunk)
