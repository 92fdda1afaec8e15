"""Turning prompts and conversations into token ids, the same way for every entry point."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a plain completion prompt, with the model's BOS rules."""
    return list(tokenizer.encode(prompt))


def encode_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of ``messages`` rendered with the model's chat template.

    Raises ValueError when the model has no chat template or the template rejects the
    conversation (e.g. roles out of order).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template; send plain prompts instead")
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # jinja raises its own types for template errors
        raise ValueError(f"the chat template rejected the conversation: {exc}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
