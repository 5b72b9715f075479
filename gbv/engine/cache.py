"""KV-cache surgery on transformers 5.x caches: replicate one row to K rows, keep one row, crop.

Checked against transformers 5.24 (``transformers/cache_utils.py``): a ``DynamicCache`` is a list of
layers; a plain ``DynamicLayer`` stores ``keys``/``values`` of shape (batch, heads, seq, head_dim) and
grows them with ``torch.cat`` on every forward. For those layers we work on the layer tensors with
views (``expand`` to replicate, a slice to keep one row, a slice to crop): nothing is copied here,
and the next forward's ``torch.cat`` materialises the result once. Any other layer type (sliding
window, quantized, ...) goes through the cache's own API (``batch_repeat_interleave``,
``batch_select_indices``, ``crop`` with a negative count).
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from gbv.errors import GbvError


def new_cache(model) -> Cache:
    """An empty dynamic cache laid out for ``model``; refuse caches that cannot be rolled back.

    A model with sliding-window attention gets full layers all the same: a sliding layer drops the
    positions before its window, so it cannot be cropped once past it (transformers raises), and
    speculation crops every iteration. The attention mask still applies the window (the model builds
    it from its config and each position), so the outputs are the same; the cache keeps every position."""
    text_config = model.config.get_text_config()
    if getattr(text_config, "sliding_window", None):
        cache = DynamicCache()  # (its layers made as plain DynamicLayer on first use)
    else:
        cache = DynamicCache(config=model.config)
    if not cache.is_croppable:
        raise GbvError(f"model {type(model).__name__} uses a KV cache that cannot be cropped; "
                       "speculative decoding needs to roll back rejected tokens")
    return cache


_CACHE_KEYWORDS: dict[type, str] = {}


def cache_keyword(model) -> str:
    """The keyword under which ``model``'s forward takes its KV cache: ``cache`` in recent
    transformers 5 releases (5.25 here), ``past_key_values`` in earlier ones (5.17 on the GPU machine),
    where a ``cache=`` would fall into ``**kwargs`` unread and every forward would see only the tokens
    fed to it, with no error. Read off the forward's signature once per model class."""
    kind = type(model)
    if kind not in _CACHE_KEYWORDS:
        try:
            names = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):  # no inspectable signature: the current name
            names = {"cache": None}
        _CACHE_KEYWORDS[kind] = "cache" if "cache" in names or "past_key_values" not in names else "past_key_values"
    return _CACHE_KEYWORDS[kind]


def _plain(layer) -> bool:
    return type(layer) is DynamicLayer


def cache_length(cache: Cache) -> int:
    """Number of positions held (the same for every attention layer)."""
    return cache.get_seq_length()


def replicate(cache: Cache, rows: int) -> None:
    """Batch-1 cache -> ``rows`` identical rows (in place). A no-op for ``rows == 1`` or an empty cache."""
    if rows == 1:
        return
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False) or layer.get_seq_length() == 0:
            continue
        if _plain(layer):
            layer.keys = layer.keys.expand(rows, *layer.keys.shape[1:])
            layer.values = layer.values.expand(rows, *layer.values.shape[1:])
        else:
            layer.batch_repeat_interleave(rows)


def select_row(cache: Cache, row: int) -> None:
    """Keep batch row ``row`` only (in place)."""
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False) or layer.get_seq_length() == 0:
            continue
        if layer.keys.shape[0] == 1:
            continue
        if _plain(layer):
            layer.keys = layer.keys[row:row + 1]
            layer.values = layer.values[row:row + 1]
        else:
            layer.batch_select_indices(torch.tensor([row], device=layer.keys.device))


def crop(cache: Cache, length: int) -> None:
    """Keep the first ``length`` positions (in place); a no-op when the cache is not longer."""
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        current = layer.get_seq_length()
        if current <= length:
            continue
        if _plain(layer):
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]
        else:
            layer.crop(length - current)  # transformers 5.x: a negative count of positions to drop
