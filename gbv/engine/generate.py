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

Settings come as one :class:`gbv.engine.config.GenerationConfig` (validated there).

Context length: the prompt must be shorter than the models' ``max_position_embeddings``;
``max_new_tokens`` is cut so that prompt + new tokens fit (a generation that reaches that cut ends with
``stop_reason == "context_limit"`` and one warning on the ``gbv`` logger), and near the end (of
``max_new_tokens`` or of the context) the block is shortened, exactly as a fresh call with a smaller
``block_len`` would do (every iteration is lossless for any L).
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from gbv.engine.config import GenerationConfig, all_methods  # noqa: F401 - all_methods re-exported
from gbv.engine.decoder import engine_for, make_decoder
from gbv.engine.detokenize import IncrementalText
from gbv.engine.static_sampling import stop_token_array
from gbv.engine.static_steps import recording_seconds
from gbv.engine.stats import GenerationStats
from gbv.errors import GbvError

logger = logging.getLogger("gbv")
DEFAULT_BATCH_SIZE = 8  # rows decoded together by generate(prompts=[...]) on the tree engine
MAX_BATCH_SIZE = 256
SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(GenerationConfig))


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


def max_positions(*models) -> int | None:
    """The context the models can hold: the smallest ``max_position_embeddings`` (None: unknown)."""
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




# ----------------------------------------------------------------------------------------------- prompts

def _config(config: GenerationConfig | None, settings: dict[str, Any]) -> GenerationConfig:
    """``config`` (default: the defaults) with the keyword ``settings`` applied; GbvError on a bad one."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise GbvError(f"unknown setting {unknown[0]!r}; the settings are: {', '.join(SETTINGS)}")
    if config is not None and not isinstance(config, GenerationConfig):
        raise GbvError(f"config must be a GenerationConfig, got {type(config).__name__}")
    base = config if config is not None else GenerationConfig()
    return base.replace(**settings) if settings else base


def _is_token(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_nested(value: Any) -> bool:
    """A prompt inside a batch: a list / tuple / tensor (not a string)."""
    return isinstance(value, (Sequence, torch.Tensor)) and not isinstance(value, (str, bytes))


def _token_list(values: Any, where: str) -> list[int]:
    """One prompt's token ids from a list/tuple of ints or a 1D integer tensor; GbvError otherwise."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise GbvError(f"{where} must be a 1D integer tensor, got shape {tuple(values.shape)} {values.dtype}")
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise GbvError(f"{where} must be a list of token ids, got {type(values).__name__}")
    if not values:
        raise GbvError(f"{where} is empty")
    bad = next((v for v in values if not _is_token(v)), None)
    if bad is not None:
        raise GbvError(f"{where} must hold integer token ids only, got {bad!r} ({type(bad).__name__})")
    return [int(v) for v in values]


def _encode(pair, text: Any, where: str) -> list[int]:
    if not isinstance(text, str):
        raise GbvError(f"{where} must be a string, got {type(text).__name__}")
    if not text:
        raise GbvError(f"{where} is empty")
    if pair.tokenizer is None:
        raise GbvError("this model pair has no tokenizer: pass prompt_ids instead of prompt text")
    # verbose=False: the tokenizer's own "sequence length is longer than..." warning would precede
    # our one-line context error (the prompt length is checked against the model in _prepare).
    ids = pair.tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"]
    if not ids:
        raise GbvError(f"{where} encodes to no tokens")
    return list(ids)


def _prompt_batch(pair, prompt, prompt_ids, prompts) -> tuple[list[list[int]], bool]:
    """The token ids of every prompt, and whether the call is a batch (returns a list).

    A batch is ``prompts=[text, ...]``, ``prompt_ids=[[ids], ...]`` (prompts may differ in length) or
    a 2D tensor (one prompt per row; one row is still a batch of 1). A list that mixes ids and lists,
    or nests deeper, is a GbvError, never flattened."""
    given = [name for name, value in (("prompt", prompt), ("prompt_ids", prompt_ids), ("prompts", prompts))
             if value is not None]
    if len(given) != 1:
        raise GbvError("give exactly one of prompt (text), prompt_ids (token ids) or prompts (a list of texts)"
                       + (f"; got {' and '.join(given)}" if given else ""))
    if prompt is not None:
        return [_encode(pair, prompt, "prompt")], False
    if prompts is not None:
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise GbvError("prompts must be a list of strings (use prompt= for one text)")
        if not prompts:
            raise GbvError("prompts is empty")
        return [_encode(pair, text, f"prompts[{i}]") for i, text in enumerate(prompts)], True
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2:
            if prompt_ids.shape[0] == 0:
                raise GbvError("prompt_ids is an empty batch (a 2D tensor with no rows)")
            return [_token_list(row, f"prompt_ids[{i}]") for i, row in enumerate(prompt_ids)], True
        return [_token_list(prompt_ids, "prompt_ids")], False
    if hasattr(prompt_ids, "tolist") and not isinstance(prompt_ids, Sequence):  # numpy arrays
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, Sequence) and not isinstance(prompt_ids, (str, bytes)) and prompt_ids \
            and _is_nested(prompt_ids[0]):
        if any(_is_token(v) for v in prompt_ids):
            raise GbvError("prompt_ids mixes token ids and lists: give one list of ids, or a list of such lists")
        return [_token_list(ids, f"prompt_ids[{i}]") for i, ids in enumerate(prompt_ids)], True
    return [_token_list(prompt_ids, "prompt_ids")], False


# ----------------------------------------------------------------------------------------------- one job

@dataclass
class _Job:
    """One prompt, checked against the pair and ready to run."""

    ids: list[int]
    config: GenerationConfig
    vocab: int
    limit: int | None  # the models' context length (positions), None = unknown
    max_new_tokens: int  # config.max_new_tokens, cut so that prompt + new tokens fit the context
    eos: frozenset[int]


def _prepare(pair, ids: list[int], config: GenerationConfig) -> _Job:
    if config.needs_draft and pair.draft is None:
        raise GbvError(f"method {config.method!r} needs a draft model (load one, or use method 'ar')")
    draft = pair.draft if config.uses_draft else None
    vocab = shared_vocab(pair.target, draft, pair.tokenizer)
    if max(ids) >= vocab or min(ids) < 0:
        raise GbvError(f"prompt token ids must be in [0, {vocab})")
    limit = max_positions(pair.target, draft)
    max_new_tokens = config.max_new_tokens
    if limit is not None:
        if len(ids) >= limit:
            raise GbvError(f"prompt has {len(ids)} tokens; the model context is {limit} positions "
                           "(shorten the prompt)")
        max_new_tokens = min(max_new_tokens, limit - len(ids))
    _check_memory(pair, config, vocab, len(ids) + max_new_tokens)
    if config.stop_strings and pair.tokenizer is None:
        raise GbvError("stop_strings need a tokenizer; this model pair has none")
    eos = _default_eos(pair) if config.eos_token_id is None else config.eos_token_id
    return _Job(ids, config, vocab, limit, max_new_tokens, frozenset(eos))


def _kv_bytes_per_position(model) -> int:
    """Bytes one cached position takes in ``model`` (keys and values of every layer); 0 if unknown."""
    cfg = model.config.get_text_config()
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads, hidden)):
        return 0
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    weight = next(model.parameters(), None)
    element = weight.element_size() if weight is not None else 4
    return 2 * layers * kv_heads * head_dim * element


def memory_estimate(pair, config: GenerationConfig, vocab: int, positions: int) -> int:
    """Rough bytes one generation allocates beyond the weights: K copies of both KV caches over
    ``positions`` tokens, and per iteration the draft's (K, L, V) and the target's (K, L+1, V)
    distributions plus the target logits (float32)."""
    if not config.uses_draft or pair.draft is None:
        return positions * _kv_bytes_per_position(pair.target) + 2 * vocab * 4
    rows, block = config.num_paths, config.block_len
    caches = rows * (positions + block) * (_kv_bytes_per_position(pair.target) + _kv_bytes_per_position(pair.draft))
    return caches + rows * (3 * block + 2) * vocab * 4


def _available_memory(device) -> int | None:
    """Free bytes on ``device`` (CUDA: the allocator's view; CPU: MemAvailable), None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_memory(pair, config: GenerationConfig, vocab: int, positions: int) -> None:
    """Refuse, before allocating anything, a generation whose estimate exceeds the free memory."""
    available = _available_memory(pair.device)
    needed = memory_estimate(pair, config, vocab, positions)
    if available is not None and needed > available:
        raise GbvError(f"this generation needs about {needed / 2**30:.1f} GiB (K={config.num_paths}, "
                       f"L={config.block_len}, {positions} positions, vocabulary {vocab}) but "
                       f"{available / 2**30:.1f} GiB are free on {pair.device}; lower num_paths, block_len "
                       "or max_new_tokens")


def _make_decoder(pair, config: GenerationConfig, vocab: int, eos: frozenset[int] = frozenset()):
    """The decoding state of one sequence (the one place that builds a decoder from a config):
    the tree engine for the lean families (``LEAN_ARCHITECTURES``), the plain Hugging Face path otherwise
    (``make_decoder``). ``eos``: the generation's EOS ids, where a run of plain steps may stop early."""
    draft = pair.draft if config.uses_draft else None
    return make_decoder(pair.target, draft, config.method, config.num_paths, config.block_len, vocab,
                        config.target_sampling, config.draft_sampling, config.seed, pair.device, eos)


@dataclass(frozen=True)
class Step:
    """What a row loop yields when it needs one decoder iteration: ``block`` caps the block length
    (0 = a plain target step). The driver runs it and sends back the newly committed tokens."""

    block: int


def _run(pair, job: _Job, emit: bool) -> Iterator[str | list[int]]:
    """One sequence: drive :func:`row_loop` with its own decoder. Yields chunks when ``emit``;
    returns the :class:`GenerationOutput`. Model work runs under ``torch.inference_mode`` but never
    across a ``yield`` (so the caller's code between chunks runs in its own mode)."""
    with torch.inference_mode():
        decoder = _make_decoder(pair, job.config, job.vocab, job.eos)
        decoder.prefill(job.ids)
    loop = row_loop(pair, job, emit, decoder)
    reply = None
    while True:
        # The mode is entered once per run of steps, not per step (~5 us each, 0.3% of a 1.6 ms step).
        with torch.inference_mode():
            while True:
                try:
                    item = loop.send(reply)
                except StopIteration as done:
                    return done.value
                if not isinstance(item, Step):
                    break
                reply = decoder.step(item.block)
        reply = None
        yield item


def row_loop(pair, job: _Job, emit: bool, decoder) -> Generator[Step | str | list[int], list[int] | None,
                                                                GenerationOutput]:
    """The stop / truncate / stream logic of one sequence, apart from the models: it yields a
    :class:`Step` whenever it needs an iteration (and receives the committed tokens), and text chunks
    when ``emit``; returns the :class:`GenerationOutput`. ``decoder`` has ``tokens``, ``stats`` and
    ``truncate`` (a single-sequence decoder, or one row of a batch, already prefilled). Text is decoded
    incrementally (only the new tokens, :class:`IncrementalText`) when streaming or watching for stop
    strings, and once in full at the end. Time spent by the caller on chunks is not counted."""
    start = time.perf_counter()
    paused = 0.0
    # (the prompt's work the decoder does inside its steps: auto's deferred draft prompt; see time_total)
    prefilled = decoder.stats.time_prefill
    config, ids, limit, max_new_tokens, eos = job.config, job.ids, job.limit, job.max_new_tokens, job.eos
    tokenizer = pair.tokenizer
    stops = list(config.stop_strings)
    longest_stop = max((len(s) for s in stops), default=0)
    prompt_len = len(ids)
    stats = decoder.stats
    shown = 0  # tokens streamed (no tokenizer) / characters streamed (tokenizer)
    incremental = IncrementalText(tokenizer) if tokenizer is not None and (emit or stops) else None
    text = None
    stop_reason = ""
    while not stop_reason:
        generated = len(decoder.tokens) - prompt_len
        remaining = max_new_tokens - generated
        room = (limit - len(decoder.tokens)) if limit is not None else remaining
        new = yield Step(min(remaining - 1, room))
        # Stop conditions on the newly committed tokens.
        keep = len(new)
        for i, token in enumerate(new):
            if token in eos:
                keep, stop_reason = i + 1, "eos"
                break
        if generated + keep >= max_new_tokens:
            keep = min(keep, max_new_tokens - generated)
            if not stop_reason:
                stop_reason = "max_new_tokens" if max_new_tokens == config.max_new_tokens else "context_limit"
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
        if incremental is None:
            continue
        searched = max(0, len(incremental.text) - longest_stop + 1)  # text before this was searched
        clean_tokens = incremental.emitted_tokens  # their text holds no stop string
        incremental.extend(decoder.tokens[prompt_len + len(incremental.ids):])
        if stop_reason or (stops and any(s in incremental.text[searched:] for s in stops)):
            # Exact, on full decodes (once per generation): cut after the fewest tokens whose text
            # contains a stop string, and the text right after it.
            out_ids = decoder.tokens[prompt_len:]
            full = tokenizer.decode(out_ids, skip_special_tokens=True)
            if stops and _first_stop(full, stops) is not None:
                n = _tokens_for_stop(tokenizer, out_ids, clean_tokens, stops)
                full = tokenizer.decode(out_ids[:n], skip_special_tokens=True)
                decoder.truncate(prompt_len + n)
                full, stop_reason = full[:_first_stop(full, stops)], "stop_string"
            if stop_reason:
                text = full
        ready = text if stop_reason else incremental.text
        if emit and len(ready) > shown:
            chunk, shown = ready[shown:], len(ready)
            pause = time.perf_counter()
            yield chunk
            paused += time.perf_counter() - pause
    if text is None and tokenizer is not None:  # not streamed and no stop strings: decode once
        text = tokenizer.decode(decoder.tokens[prompt_len:], skip_special_tokens=True)
    if stop_reason == "context_limit":
        logger.warning("max_new_tokens=%d was cut to %d: the prompt (%d tokens) and the new tokens must fit "
                       "the model context of %d positions (stop_reason 'context_limit')",
                       config.max_new_tokens, max_new_tokens, prompt_len, limit)
    stats.stop_reason = stop_reason
    stats.new_tokens = len(decoder.tokens) - prompt_len
    stats.time_total = time.perf_counter() - start - paused - (stats.time_prefill - prefilled)
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


def _finish(iterator: Iterator[str | list[int]], stream: Callable[[str | list[int]], Any] | None
            ) -> GenerationOutput:
    while True:
        try:
            chunk = next(iterator)
        except StopIteration as done:
            return done.value
        if stream is not None:
            stream(chunk)


def _generate_many(pair, jobs: list[_Job], batch_size: int = DEFAULT_BATCH_SIZE) -> list[GenerationOutput]:
    """Every prompt of a batch. On the tree engine (the lean families) up to ``batch_size`` rows decode
    together (one draft forward per depth and one target forward per iteration for all of them; a
    finished row is replaced by the next prompt between iterations); elsewhere, one after another.
    Each job carries its own seed and generator, so a row's output does not depend on the others."""
    if batch_size <= 1 or len(jobs) == 1 or engine_for(pair.target, pair.draft) != "tree":
        return [_finish(_run(pair, job, emit=False), None) for job in jobs]
    from gbv.engine.batch import BatchTreeDecoder

    rows = BatchRows(pair, BatchTreeDecoder(pair.target, pair.draft, jobs[0].vocab, pair.device,
                                            min(batch_size, len(jobs))))
    results: list[GenerationOutput | None] = [None] * len(jobs)
    waiting = list(enumerate(jobs))[::-1]
    while waiting or rows.active:
        while waiting and rows.has_room():
            index, job = waiting.pop()
            rows.add(index, job, emit=False)
        for key, event, value in rows.step():
            if event == "done":
                results[key] = value
    return results


class _BatchRowView:
    """One row of a :class:`~gbv.engine.batch.BatchTreeDecoder` with the single-decoder interface that
    :func:`row_loop` uses (``tokens``, ``stats``, ``truncate``)."""

    def __init__(self, batch, row) -> None:
        self.batch, self.row = batch, row

    @property
    def tokens(self) -> list[int]:
        return self.row.tokens

    @property
    def stats(self) -> GenerationStats:
        return self.row.stats

    def truncate(self, length: int) -> None:
        self.batch.truncate(self.row, length)


class BatchRows:
    """The rows of a batch being decoded together, each driven by its own :func:`row_loop`; the one
    scheduler behind ``generate(prompts=...)`` and ``gbv serve``. ``add`` prefills a job into a free
    row; ``step`` runs one iteration for every active row and returns ``(key, event, value)`` with
    event ``"chunk"`` (streamed text), ``"done"`` (the GenerationOutput; the row is freed) or
    ``"error"`` (an exception; the row is freed); ``cancel`` frees a row at once."""

    def __init__(self, pair, batch) -> None:
        self.pair = pair
        self.batch = batch
        self.active: dict[Any, tuple[Any, Any, Step]] = {}  # key -> (row, loop, pending step)

    def has_room(self) -> bool:
        return len(self.active) < self.batch.max_rows

    def add(self, key, job: _Job, emit: bool) -> list[tuple[Any, str, Any]]:
        config = job.config
        method, num_paths, block_len = config.method, config.num_paths, config.block_len
        auto_arms = None
        if method == "auto":  # sized for its longest arm; each step then sets the chosen arm
            from gbv.engine import auto

            auto_arms = auto.default_arms(config.draft_sampling.greedy, self.pair.draft is not None)
            speculative = [arm for arm in auto_arms if arm.method != "ar"] or [auto.Arm("ar", 1, 1)]
            method = speculative[0].method
            num_paths = max(max(arm.num_paths for arm in speculative), 1)
            block_len = max(max(arm.block_len for arm in speculative), 1)
        with torch.inference_mode():
            row = self.batch.add_row(job.ids, method, num_paths, block_len, config.target_sampling,
                                     config.draft_sampling, config.seed)
        row.auto = None
        row.auto_policy = None  # (bucket, policy) of the batch size it last ran at (_choose_arms)
        row.stop_tokens = stop_token_array(job.eos)
        if auto_arms is not None:
            row.stats.method = "auto"
            row.auto = (auto_arms, (config.target_sampling, config.draft_sampling, job.vocab))
        loop = row_loop(self.pair, job, emit, _BatchRowView(self.batch, row))
        return self._advance(key, row, loop, None)

    def cancel(self, key) -> None:
        entry = self.active.pop(key, None)
        if entry is not None:
            entry[1].close()
            self.batch.remove_row(entry[0])

    def reset(self) -> list:
        """Drop every row at once, without moving any cache row (what a failed shared step leaves
        cannot be trusted); returns the keys that were active. The caches stay allocated for the next
        rows."""
        keys = list(self.active)
        for _, loop, _ in self.active.values():
            try:
                loop.close()
            except Exception:  # noqa: BLE001 - the row is dropped either way
                pass
        self.active.clear()
        self.batch.remove_all_rows()
        return keys

    def _advance(self, key, row, loop, reply) -> list[tuple[Any, str, Any]]:
        """Run ``loop`` until it asks for the next step (or ends); collect its events."""
        events = []
        while True:
            try:
                item = loop.send(reply)
            except StopIteration as done:
                self.active.pop(key, None)
                self.batch.remove_row(row)
                events.append((key, "done", done.value))
                return events
            except Exception as exc:  # noqa: BLE001 - one bad row must not stop the others
                self.active.pop(key, None)
                self.batch.remove_row(row)
                events.append((key, "error", exc))
                return events
            if isinstance(item, Step):
                self.active[key] = (row, loop, item)
                return events
            events.append((key, "chunk", item))
            reply = None

    def step(self) -> list[tuple[Any, str, Any]]:
        if not self.active:
            return []
        entries = list(self.active.items())
        blocks = {id(row): step.block for _, (row, _, step) in entries}
        # (a lone row's plain steps run several to a call: at most what its cap allows, as for one sequence)
        plain_limits = {id(row): step.block + 1 for _, (row, _, step) in entries} if len(entries) == 1 else None
        # (the rows' mean context: what the step's attention reads, at which auto rates and records its arms)
        context = sum(len(row.tokens) for _, (row, _, _) in entries) / len(entries)
        chosen = self._choose_arms([(row, step) for _, (row, _, step) in entries], context)
        models = (self.batch.target, self.batch.draft)
        # What plain steps left the drafts of the auto rows that speculate now: fed first and timed apart,
        # as the cost of switching (AutoPolicy.record_rows), not the arm's own (see catch_up_drafts).
        lagging = [row for row, policy, index, _ in chosen if policy.arms[index].method != "ar"]
        switching = 0.0
        if lagging:
            switch_start, recorded = time.perf_counter(), recording_seconds(models)
            self.batch.catch_up_drafts(lagging)
            switching = time.perf_counter() - switch_start - (recording_seconds(models) - recorded)
        start, recorded = time.perf_counter(), recording_seconds(models)
        for row, policy, index, _ in chosen:
            blocks[id(row)] = min(blocks[id(row)], policy.arms[index].block_len)
        new = self.batch.step(blocks, plain_limits)
        # (the step read its drafts and results back: work is done; CUDA graphs recorded on the way are
        # a once-per-process cost, not the arms', as in AutoDecoder)
        seconds = time.perf_counter() - start - (recording_seconds(models) - recorded)
        runs: dict[int, tuple[Any, int, list[int]]] = {}  # policy -> (policy, arm, the tokens of its rows)
        for row, policy, index, whole in chosen:
            label = policy.arms[index].label
            # (a lone row's run of ar's steps counts each step, as AutoDecoder counts them)
            steps = len(new[id(row)]) if policy.arms[index].method == "ar" else 1
            row.stats.auto_arms[label] = row.stats.auto_arms.get(label, 0) + steps
            if whole:  # (a row whose cap cut the arm's block ran another iteration: not the arm's)
                runs.setdefault(id(policy), (policy, index, []))[2].append(len(new[id(row)]))
        for policy, index, row_tokens in runs.values():  # the rows' share of the step, as one iteration
            share = len(row_tokens) / len(entries)
            if policy.arms[index].method == "ar" and len(row_tokens) == 1 and row_tokens[0] > 1:  # (a lone row's run:
                # a record a step, as AutoDecoder records one sequence's runs)
                steps = row_tokens[0]
                for step in range(steps):
                    policy.record_rows(index, [1], seconds * share / steps, switching * share / steps, context + step)
                continue
            policy.record_rows(index, row_tokens, seconds * share, switching * share, context)
        events = []
        for key, (row, loop, _) in entries:
            events += self._advance(key, row, loop, new[id(row)])
        return events

    def _choose_arms(self, rows_steps: list, context: float | None = None) -> list[tuple[Any, Any, int, bool]]:
        """One arm for this step for all the ``auto`` rows that share a policy (their settings, and the
        batch size rounded up to a power of 2: what pays at 16 rows, a compute-bound target pass, is not
        what pays for one; one row shares the single-sequence policy), rated at the rows' mean ``context``
        (auto._PRIOR_CONTEXT). Returns ``(row, policy, arm
        index, whole)`` per auto row; ``whole``: the row's cap (near its end) leaves the arm's block as
        it is, so its iteration is the arm's to record.

        Why one arm for all of them: each row is credited its share of the step's seconds, which only
        measures the arm when every row runs it. Chosen row by row, a row running ``ar`` in a step that
        another row's 24-node trie made slow was charged for that trie, and the trie's row was charged
        a sixteenth of it: at 16 rows in bfloat16 ``auto`` made 0.63-0.75x ``ar``'s tokens/s, its best
        arm. Lossless as before: the choice depends only on the rows' past."""
        from gbv.engine import auto
        from gbv.engine.decoder import set_method

        bucket = 1 << (len(rows_steps) - 1).bit_length()
        groups: dict[int, tuple[Any, list]] = {}
        for row, step in rows_steps:
            if row.auto is None:
                continue
            arms, key = row.auto
            # The row's policy for this batch size, looked up once a size (policy_for hashes the
            # row's arms and settings: at 16 rows that was ~3% of an `ar` step in bfloat16).
            cached = row.auto_policy
            if cached is not None and cached[0] == bucket:
                policy = cached[1]
            else:
                policy = auto.policy_for(self.pair.target, self.pair.draft, key if bucket == 1 else (*key, bucket),
                                         arms)
                row.auto_policy = (bucket, policy)
            groups.setdefault(id(policy), (policy, []))[1].append((row, step.block))
        chosen = []
        for policy, members in groups.values():
            index = policy.choose(max(block for _, block in members), context=context)  # (the longest cap: the others cut)
            arm = policy.arms[index]
            for row, block in members:
                if arm.method != "ar":
                    set_method(row, arm.method, arm.num_paths, arm.block_len)
                chosen.append((row, policy, index, block >= arm.block_len))
        return chosen


# ----------------------------------------------------------------------------------------------- API

def stream_generate(pair, prompt: str | None = None, prompt_ids: Sequence[int] | torch.Tensor | None = None, *,
                    config: GenerationConfig | None = None, **settings: Any) -> Iterator[str | list[int]]:
    """Iterator form of :func:`generate` for one prompt: validates now (GbvError), then returns an
    iterator that yields text chunks (token-id lists without a tokenizer) as they are committed and
    returns the :class:`GenerationOutput` (``StopIteration.value``; or use :class:`Generation`)."""
    config = _config(config, settings)
    batch, is_batch = _prompt_batch(pair, prompt, prompt_ids, None)
    if is_batch:
        raise GbvError("stream_generate takes one prompt; use generate(pair, prompts=[...]) for a batch")
    return _run(pair, _prepare(pair, batch[0], config), emit=True)


def prepare_job(pair, prompt_ids: Sequence[int], **settings: Any) -> _Job:
    """One request checked against the pair (GbvError on bad input), ready for :class:`BatchRows`."""
    return _prepare(pair, _token_list(prompt_ids, "prompt_ids"), _config(None, settings))


class Generation:
    """``for chunk in Generation(pair, prompt=...): ...`` then ``.output`` holds the GenerationOutput."""

    def __init__(self, pair, **kwargs: Any) -> None:
        self._iterator = stream_generate(pair, **kwargs)
        self.output: GenerationOutput | None = None

    def __iter__(self) -> Iterator[str | list[int]]:
        self.output = yield from self._iterator
        return self.output


def generate(pair, prompt: str | None = None, prompt_ids: Sequence[int] | torch.Tensor | None = None, *,
             prompts: Sequence[str] | None = None, config: GenerationConfig | None = None,
             stream: Callable[[str | list[int]], Any] | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
             **settings: Any) -> GenerationOutput | list[GenerationOutput]:
    """Sample up to ``max_new_tokens`` tokens from ``pair.target`` (exactly its law), drafting with
    ``pair.draft`` and verifying with ``method`` (``ar`` = target only; or any of :data:`gbv.verify.METHODS`).

    Settings are the fields of :class:`GenerationConfig`, given as keywords (``method="gbv",
    num_paths=3, block_len=8, temperature=1.0, draft_temperature=None, top_k=0, top_p=1.0,
    max_new_tokens=128, eos_token_id=None, stop_strings=None, seed=0``) and/or as ``config=``
    (keywords override it). ``num_paths`` is capped at 16 and ``block_len`` at 32 (see
    :mod:`gbv.engine.config`). ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 are off; the
    draft uses ``draft_temperature`` (default: ``temperature``) and the same top-k / top-p.
    ``eos_token_id``: None = the tokenizer's / generation config's, ``[]`` = none. Generation stops
    after an EOS token (kept), at ``max_new_tokens``, at the model context (``stop_reason``
    ``context_limit``, one warning on the ``gbv`` logger), or when the text contains one of
    ``stop_strings`` (text and tokens are cut right after it). ``stream`` receives text chunks
    (token-id lists without a tokenizer) as they are committed. Same ``seed`` and settings -> the
    same tokens, for every fixed method; ``method="auto"`` (the default) keeps the target's law
    exactly but picks its (method, K, L) per iteration from measured speed, so its tokens for a seed
    can vary from run to run: name a method for bit-reproducible output. Bad input raises GbvError.

    Batches: ``prompts=[text, ...]``, ``prompt_ids=[[ids], ...]`` or a 2D ``(batch, length)`` tensor
    (one row is still a batch of 1) return a list of GenerationOutput, one per prompt, in order.
    Prompt ``i`` is sampled with seed ``seed + i``, exactly as ``generate(pair, <prompt i>, seed=seed + i)``
    would: its output does not depend on the other prompts, and a prompt repeated in a batch gives
    independent samples. ``stream`` takes one prompt only. On the tree engine (the lean families) up to
    ``batch_size`` prompts decode together in shared forwards (docs/ENGINE.md); ``auto`` rows of a
    batch choose their arm per iteration from a policy of their settings and of the batch size.
    """
    config = _config(config, settings)
    batch, is_batch = _prompt_batch(pair, prompt, prompt_ids, prompts)
    if not is_batch:
        return _finish(_run(pair, _prepare(pair, batch[0], config), emit=stream is not None), stream)
    if stream is not None:
        raise GbvError("stream works with one prompt; drop stream= or generate the prompts one by one")
    jobs = [_prepare(pair, ids, config.replace(seed=config.seed + i)) for i, ids in enumerate(batch)]
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise GbvError(f"batch_size must be an integer from 1 to {MAX_BATCH_SIZE}, got {batch_size!r}")
    return _generate_many(pair, jobs, batch_size)
