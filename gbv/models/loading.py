"""Load a target/draft pair of causal language models (and their shared tokenizer).

    pair = gbv.load_pair("bundled")                               # the small pair shipped with gbv
    pair = gbv.load_pair(target="path/or/hub-id", draft="...")     # local dirs or the local hub cache
    pair = ModelPair(target=model_a, draft=model_b)                # model objects (tests; no tokenizer)

Nothing is downloaded unless ``allow_download=True``.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from gbv.errors import GbvError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


@dataclass
class ModelPair:
    """A target model, a draft model (None for target-only ``ar`` decoding), and their tokenizer.
    ``device`` defaults to where the target's weights are ("cpu" for a model without any)."""

    target: Any
    draft: Any = None
    tokenizer: Any = None
    device: str | None = None
    dtype: torch.dtype | None = None
    names: tuple[str, str] = field(default=("target", "draft"))

    def __post_init__(self) -> None:
        if self.device is None:
            # Not a fixed "cpu": a pair built from models already on a GPU must decode there (the
            # decoder puts its token tensors and its generator on ``pair.device``).
            tensors = (itertools.chain(self.target.parameters(), self.target.buffers())
                       if isinstance(self.target, torch.nn.Module) else iter(()))
            first = next(tensors, None)
            self.device = "cpu" if first is None else str(first.device)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``None``/``"auto"`` -> None (the checkpoint's dtype); a name or a torch dtype -> torch dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in _DTYPES:
        raise GbvError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def parse_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise GbvError(f"unknown device {device!r} ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GbvError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    return dev


def _is_path_like(name: str) -> bool:
    """A filesystem path rather than a hub id (``org/name`` or ``name``)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _in_hub_cache(name: str) -> bool:
    """Whether the local hub cache holds ``name``'s config.json (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


def _load_model(name: str, device: torch.device, dtype: torch.dtype | None, allow_download: bool):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        name = expanded
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise GbvError(f"model directory {name!r} has no config.json")
    elif os.path.exists(expanded):
        raise GbvError(f"model path {name!r} is not a directory")
    elif _is_path_like(name):
        raise GbvError(f"model path {name!r} does not exist")
    elif not allow_download and not _in_hub_cache(name):
        # Say what happened: nothing was looked up online, so quote no connection error.
        raise GbvError(f"model {name!r} is not a local directory and not in the local hub cache; nothing is "
                       "downloaded without --allow-download (allow_download=True in Python)")

    kwargs: dict[str, Any] = {"local_files_only": not allow_download}
    if dtype is not None:
        kwargs["dtype"] = dtype
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" bars would break one-line CLI output
    try:
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GbvError(f"cannot load model {name!r}: {first}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()


def _load_tokenizer(name: str, allow_download: bool):
    from transformers import AutoTokenizer

    path = os.path.expanduser(name)
    try:
        return AutoTokenizer.from_pretrained(path if os.path.isdir(path) else name, local_files_only=not allow_download)
    except Exception:  # noqa: BLE001 - a model saved without tokenizer files is fine (token-id API)
        return None


def check_tokenizers(target_tok, draft_tok) -> None:
    """Raise :class:`GbvError` when both tokenizers exist and map strings to different ids."""
    if target_tok is None or draft_tok is None:
        return
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise GbvError("target and draft tokenizers differ (different vocabularies); speculative decoding "
                       "needs one shared tokenizer")


def _bundled() -> tuple[str, str]:
    from gbv.models.bundled import bundled_paths  # raises GbvError naming any missing file

    target, draft = bundled_paths()
    return str(target), str(draft)


def load_pair(target: str | None = "bundled", draft: str | None = None, device: str = "cpu",
              dtype: str | torch.dtype | None = None, allow_download: bool = False) -> ModelPair:
    """Load ``target`` and ``draft`` (local directories or hub ids already in the local cache).

    ``load_pair("bundled")`` (the default) loads the pair shipped with gbv. ``draft=None`` with a
    non-bundled target loads the target only (enough for ``method="ar"``). The tokenizer is the
    target's; when both directories carry one they must agree. Models are put in eval mode on
    ``device`` in ``dtype`` (None: the checkpoint's dtype). Raises :class:`GbvError` on any bad input.
    """
    dev = parse_device(device)
    torch_dtype = parse_dtype(dtype)
    names = None
    if target is None or target == "bundled":
        if draft is not None and draft != "bundled":
            raise GbvError("give --target together with --draft (or neither, for the bundled pair)")
        target, draft = _bundled()
        names = ("bundled/target", "bundled/draft")  # not this machine's install path, in reports
    target_model = _load_model(target, dev, torch_dtype, allow_download)
    draft_model = _load_model(draft, dev, torch_dtype, allow_download) if draft is not None else None
    tokenizer = _load_tokenizer(target, allow_download)
    if draft is not None:
        check_tokenizers(tokenizer, _load_tokenizer(draft, allow_download))
    return ModelPair(target=target_model, draft=draft_model, tokenizer=tokenizer, device=str(dev),
                     dtype=torch_dtype,
                     names=names or (str(target), str(draft) if draft is not None else ""))
