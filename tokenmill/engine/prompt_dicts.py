"""vLLM's prompt dicts, ``TextPrompt`` and ``TokensPrompt``, so its scripts run unchanged.

They are TypedDicts, as vLLM's (``vllm.inputs``): plain dicts when built, checked only by a
type checker. ``LLM.generate`` reads them (llm.py):

    TextPrompt(prompt="Hi")                          the text, encoded with the model's BOS rules
    TokensPrompt(prompt_token_ids=[1, 2])            the ids, run as they are
    TokensPrompt(prompt_token_ids=ids, prompt=text)  the ids; the text is the result's prompt

Their other keys serve other kinds of models (images, audio, embeddings) or features the
engine lacks; a prompt that gives one is refused by name, unless it holds None (vLLM's
scripts pass ``multi_modal_data=None`` through helpers).
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

__all__ = ["PROMPT_KEYS", "UNSUPPORTED_PROMPT_KEYS", "TextPrompt", "TokensPrompt"]


class TextPrompt(TypedDict):
    """A text prompt (vLLM's ``vllm.inputs.TextPrompt``)."""

    prompt: str
    # vLLM's; refused unless None (UNSUPPORTED_PROMPT_KEYS)
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[dict[str, Any] | None]
    multi_modal_uuids: NotRequired[Any]
    cache_salt: NotRequired[str | None]


class TokensPrompt(TypedDict):
    """A prompt as token ids, with its text as ``prompt`` if you like (vLLM's
    ``vllm.inputs.TokensPrompt``)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    # vLLM's; refused unless None (UNSUPPORTED_PROMPT_KEYS)
    token_type_ids: NotRequired[list[int] | None]
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[dict[str, Any] | None]
    multi_modal_uuids: NotRequired[Any]
    cache_salt: NotRequired[str | None]


# The keys the engine reads.
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
# vLLM's other keys, with why the engine cannot honour them (a None value is taken as unset).
UNSUPPORTED_PROMPT_KEYS = {
    "multi_modal_data": "the engine runs text-only models",
    "mm_processor_kwargs": "the engine runs text-only models",
    "multi_modal_uuids": "the engine runs text-only models",
    "token_type_ids": "the engine runs decoder-only models, which take none",
    "cache_salt": "the prefix cache is not salted per request",
    "prompt_embeds": "the engine takes text or token ids, not embeddings",
}
