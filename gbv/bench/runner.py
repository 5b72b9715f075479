"""The model benchmark: every (dataset, prompt, setting) through ``gbv.generate`` or transformers.

``hf-assisted`` is transformers' own assisted generation (``target.generate(assistant_model=draft)``)
with the assistant's block fixed to L tokens (``num_assistant_tokens=L``, schedule ``constant``, no
confidence-based early stop) and top-k disabled (transformers defaults to top-k 50 otherwise), so it
samples from the same distributions as our methods. ``hf-ar`` is plain ``target.generate``.
Target forward calls of the transformers rows are counted with a forward pre-hook (every call,
including the prefill, which also yields the first new token -- as in the engine).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gbv.bench.grid import HF_METHODS, Setting
from gbv.errors import GbvError


@dataclass
class Prompt:
    dataset: str
    index: int
    text: str
    ids: list[int]


def prompt_text(item: Any) -> str:
    """Text of one item of ``gbv.data.load_prompts`` (a string, a dict, or an object with a prompt)."""
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        for key in ("prompt", "text", "question", "input"):
            if isinstance(item.get(key), str):
                return item[key]
    for attr in ("prompt", "text"):
        value = getattr(item, attr, None)
        if isinstance(value, str):
            return value
    raise GbvError(f"cannot read the prompt text of a dataset item of type {type(item).__name__}")


def load_dataset_prompts(dataset: str, limit: int, tokenizer: Any) -> list[Prompt]:
    from gbv.data import load_prompts

    items = list(load_prompts(dataset, limit=limit))[:limit]
    if not items:
        raise GbvError(f"dataset {dataset!r} returned no prompts")
    prompts = []
    for index, item in enumerate(items):
        text = prompt_text(item)
        ids = tokenizer(text)["input_ids"]
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        prompts.append(Prompt(dataset, index, text, [int(t) for t in ids]))
    return prompts


def prompt_seed(seed: int, dataset_index: int, prompt_index: int) -> int:
    """The sampling seed of one prompt: the same for every method, different across prompts."""
    return (seed * 1_000_003 + dataset_index * 10_007 + prompt_index) % (2**31 - 1)


def _eos_id(pair: Any) -> int | None:
    tok = getattr(pair, "tokenizer", None)
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None
    if eos is None:
        eos = getattr(getattr(pair.target, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


# ---------------------------------------------------------------------- engine methods
def run_engine(pair: Any, prompt: Prompt, setting: Setting, max_new_tokens: int, seed: int,
               eos_token_id: int | None) -> dict:
    import gbv

    kwargs: dict[str, Any] = dict(prompt_ids=prompt.ids, method=setting.method, temperature=setting.temperature,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, seed=seed)
    if setting.method != "ar":
        kwargs.update(num_paths=setting.num_paths, block_len=setting.block_len)
    out = gbv.generate(pair, **kwargs)
    stats = out.stats.to_dict() if hasattr(out.stats, "to_dict") else dict(vars(out.stats))
    new_tokens = int(stats.get("new_tokens", len(out.token_ids)))
    calls = stats.get("target_calls")
    accepted = stats.get("accepted_lengths")
    time_total = stats.get("time_total")
    return {
        "new_tokens": new_tokens,
        "target_calls": None if calls is None else int(calls),
        "draft_steps": stats.get("draft_steps"),
        "accepted_lengths": None if accepted is None else [int(a) for a in accepted],
        "time_draft": stats.get("time_draft"),
        "time_target": stats.get("time_target"),
        "time_verify": stats.get("time_verify"),
        "time_other": stats.get("time_other"),
        "time_total": time_total,
        "tokens_per_second": (new_tokens / time_total) if time_total else stats.get("tokens_per_second"),
    }


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
    device = getattr(pair, "device", None) or next(target.parameters()).device
    input_ids = torch.tensor([prompt.ids], dtype=torch.long, device=device)
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
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(input_ids, **kwargs)
        elapsed = time.perf_counter() - start
    finally:
        target_calls.remove()
        if draft_calls is not None:
            draft_calls.remove()
        if saved_cfg is not None:
            for k, v in saved_cfg.items():
                setattr(draft.generation_config, k, v)
    sequences = out.sequences if hasattr(out, "sequences") else out
    new_tokens = int(sequences.shape[1] - input_ids.shape[1])
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
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except Exception:  # pragma: no cover - logging only
        pass
    logging.getLogger("transformers").setLevel(logging.ERROR)


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
