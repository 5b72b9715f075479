"""The model benchmark: every (dataset, prompt, setting) through ``gbv.generate`` or transformers.

``hf-assisted`` is transformers' own assisted generation (``target.generate(assistant_model=draft)``)
with the assistant's block fixed to L tokens (``num_assistant_tokens=L``, schedule ``constant``, no
confidence-based early stop) and top-k disabled (transformers defaults to top-k 50 otherwise), so it
samples from the same distributions as our methods. ``hf-ar`` is plain ``target.generate``.
Target forward calls of the transformers rows are counted with a forward pre-hook (every call,
including the prefill, which also yields the first new token -- as in the engine).

Every row's ``time_total`` (and tokens/s) is end to end: the wall time of the generate call, the prompt's
prefill included, since that is the only time transformers' rows have. The engine's rows also keep its
own split: ``time_prefill`` (the prompt through the models) and ``time_decode`` (the generation after it,
``GenerationStats.time_total``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gbv.bench.grid import HF_METHODS, NO_DRAFT, Setting


@dataclass
class Prompt:
    dataset: str
    index: int
    text: str
    ids: list[int]


def load_dataset_prompts(dataset: str, limit: int, tokenizer: Any) -> list[Prompt]:
    """The first ``limit`` prompts of ``dataset`` (strings, from :func:`gbv.data.load_prompts`), encoded."""
    from gbv.data import load_prompts

    return [Prompt(dataset, index, text, list(tokenizer(text, verbose=False)["input_ids"]))
            for index, text in enumerate(load_prompts(dataset, limit=limit))]


def prompt_seed(seed: int, dataset_index: int, prompt_index: int) -> int:
    """The sampling seed of one prompt: the same for every method, different across prompts."""
    return (seed * 1_000_003 + dataset_index * 10_007 + prompt_index) % (2**31 - 1)


def eos_id(pair: Any) -> int | None:
    """The one EOS id both runners stop on (the tokenizer's, else the generation config's first)."""
    eos = pair.tokenizer.eos_token_id
    if eos is None:
        eos = pair.target.generation_config.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


# ---------------------------------------------------------------------- engine methods
def engine_config(setting: Setting, max_new_tokens: int, seed: int, eos_token_id: int | None):
    """The :class:`GenerationConfig` of one grid cell (``ar`` ignores K and L)."""
    from gbv.engine.config import GenerationConfig

    drafts = setting.method not in NO_DRAFT and setting.block_len is not None  # auto: its own K and L
    return GenerationConfig(method=setting.method, num_paths=setting.num_paths if drafts else 1,
                            block_len=setting.block_len if drafts else 1, temperature=setting.temperature,
                            max_new_tokens=max_new_tokens, seed=seed,
                            eos_token_id=() if eos_token_id is None else eos_token_id)


def run_engine(pair: Any, prompt: Prompt, setting: Setting, max_new_tokens: int, seed: int,
               eos_token_id: int | None) -> dict:
    import gbv

    _sync(pair.device)
    start = time.perf_counter()
    out = gbv.generate(pair, prompt_ids=prompt.ids, config=engine_config(setting, max_new_tokens, seed, eos_token_id))
    _sync(pair.device)
    elapsed = time.perf_counter() - start
    stats = out.stats
    return {
        "new_tokens": stats.new_tokens,
        "target_calls": stats.target_calls,
        "draft_steps": stats.draft_steps,
        "accepted_lengths": list(stats.accepted_lengths),
        "time_draft": stats.time_draft,
        "time_target": stats.time_target,
        "time_verify": stats.time_verify,
        "time_other": stats.time_other,
        # End to end, as the transformers rows are timed (their prefill cannot be timed apart): the
        # wall time of the call, the prompt's prefill included; the engine's own split beside it.
        "time_total": elapsed,
        "time_prefill": stats.time_prefill,
        "time_decode": stats.time_total,
        "tokens_per_second": stats.new_tokens / elapsed if elapsed > 0 else None,
    }


def _sync(device: Any) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------- transformers peers
class _CallCounter:
    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module: torch.nn.Module, inputs: Any) -> None:
        self.calls += 1

    def remove(self) -> None:
        self._handle.remove()


def run_hf(pair: Any, prompt: Prompt, setting: Setting, max_new_tokens: int, seed: int,
           eos_token_id: int | None) -> dict:
    target, draft = pair.target, pair.draft
    input_ids = torch.tensor([prompt.ids], dtype=torch.long, device=pair.device)
    kwargs: dict[str, Any] = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                  min_new_tokens=0, do_sample=setting.temperature > 0, top_k=0, top_p=1.0,
                                  num_beams=1, eos_token_id=eos_token_id,
                                  pad_token_id=eos_token_id if eos_token_id is not None else 0)
    if setting.temperature > 0:
        kwargs["temperature"] = setting.temperature
    saved_cfg = None
    if setting.method == "hf-assisted":
        # The candidate generator reads these from the *assistant's* generation config.
        gen_cfg = draft.generation_config
        saved_cfg = {k: getattr(gen_cfg, k, None) for k in
                     ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
        gen_cfg.num_assistant_tokens = setting.block_len
        gen_cfg.num_assistant_tokens_schedule = "constant"
        gen_cfg.assistant_confidence_threshold = 0.0
        kwargs.update(assistant_model=draft, num_assistant_tokens=setting.block_len,
                      num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    target_calls = _CallCounter(target)
    draft_calls = _CallCounter(draft) if setting.method == "hf-assisted" else None
    try:
        torch.manual_seed(seed)
        _sync(pair.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(input_ids, **kwargs)
        _sync(pair.device)
        elapsed = time.perf_counter() - start
    finally:
        target_calls.remove()
        if draft_calls is not None:
            draft_calls.remove()
        if saved_cfg is not None:
            for k, v in saved_cfg.items():
                setattr(draft.generation_config, k, v)
    new_tokens = int(out.shape[1] - input_ids.shape[1])
    return {
        "new_tokens": new_tokens,
        "target_calls": target_calls.calls,
        "draft_steps": draft_calls.calls if draft_calls is not None else 0,
        "accepted_lengths": None,  # not exposed by transformers
        "time_draft": None, "time_target": None, "time_verify": None, "time_other": None,
        "time_total": elapsed,
        "tokens_per_second": new_tokens / elapsed if elapsed > 0 else None,
    }


def run_one(pair: Any, prompt: Prompt, setting: Setting, max_new_tokens: int, seed: int,
            eos_token_id: int | None) -> dict:
    runner: Callable = run_hf if setting.method in HF_METHODS else run_engine
    result = runner(pair, prompt, setting, max_new_tokens, seed, eos_token_id)
    record = {"dataset": prompt.dataset, "prompt_index": prompt.index, "prompt_tokens": len(prompt.ids),
              "method": setting.method, "K": setting.num_paths, "L": setting.block_len,
              "T": setting.temperature, "seed": seed, "max_new_tokens": max_new_tokens}
    record.update(result)
    calls = record.get("target_calls")
    record["block_efficiency"] = record["new_tokens"] / calls if calls else None
    return record


def quiet_transformers() -> None:
    """Only errors from transformers (its per-call generation notices would break the progress bar)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def warm_up(pair: Any, prompt: Prompt, settings: list[Setting], eos_token_id: int | None) -> None:
    """One short untimed run per kind of runner (first-call costs: allocations, lazy imports)."""
    seen: set[str] = set()
    for setting in settings:
        kind = "hf" if setting.method in HF_METHODS else "engine"
        kind += "-assisted" if setting.method == "hf-assisted" else ""
        if kind in seen:
            continue
        seen.add(kind)
        run_one(pair, prompt, setting, 4, 0, eos_token_id)
