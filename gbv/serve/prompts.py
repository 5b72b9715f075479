"""Chat messages -> prompt token ids.

A tokenizer with a chat template uses it (``add_generation_prompt=True``). Without one (the bundled
pair has none) the messages become a plain transcript, one ``role: content`` line per message, then
``assistant:`` for the model to continue::

    system: You are terse.
    user: What is 2 + 2?
    assistant:

That transcript is tokenized like a completions prompt (with the tokenizer's special tokens).
"""

from __future__ import annotations

from collections.abc import Sequence


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def transcript(messages: Sequence[dict[str, str]]) -> str:
    """The fallback prompt: ``role: content`` lines and a final ``assistant:``."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])


def chat_prompt_ids(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of the prompt for ``messages`` (see the module docstring)."""
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        # The template writes its own special tokens (BOS and the like): do not add them twice.
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(transcript(messages), add_special_tokens=True)["input_ids"])
