"""Incremental detokenisation: the text of a growing token list, decoding only a short window per step.

Decoding the whole output after every iteration costs O(n) per step and O(n^2) per generation. Here
each call decodes only the tokens since the last emitted chunk, plus the chunk before it as context
(so that tokenizers whose decoding depends on the left neighbour -- SentencePiece's leading space,
byte-level BPE's split characters -- see it), as in vLLM's and transformers' streamers. A chunk
ending in U+FFFD (a character whose bytes are not all drafted yet) is held back until it completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalText:
    """``extend(new_ids)`` returns the text the new tokens add; ``text`` is everything emitted so far."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._context = 0  # start of the context window (the last emitted chunk's tokens)
        self._emitted = 0  # tokens whose text is in ``self.text``

    @property
    def emitted_tokens(self) -> int:
        """How many leading tokens ``text`` covers (the rest wait for a complete character)."""
        return self._emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def extend(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self._context:self._emitted])
        after = self._decode(self.ids[self._context:])
        if after.endswith("\ufffd") or len(after) <= len(before) or not after.startswith(before):
            return ""
        chunk = after[len(before):]
        self._context, self._emitted = self._emitted, len(self.ids)
        self.text += chunk
        return chunk
