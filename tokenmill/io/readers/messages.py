"""Checking chat conversations: a non-empty list of {role, content} messages.

OpenAI's spellings that carry only text are accepted as they are written: the ``developer``
role (what OpenAI's newer models call system messages) becomes ``system``, which chat
templates know, and content given as a list of parts, ``[{"type": "text", "text": ...}]``,
becomes the parts' texts joined by newlines (as vLLM joins them). Other parts (images,
audio) are refused naming the part: the engine runs text-only models.
"""

from __future__ import annotations

from typing import Any

from tokenmill.io.readers.row_error import RowError, short_repr, type_name

ROLES = ("system", "user", "assistant", "tool")
ALIASES = {"developer": "system"}


def check_messages(value: Any, where: str, row_id: str | None) -> list[dict[str, Any]]:
    """``value`` as a list of message dicts, or RowError naming ``where`` (a column or field).

    Each message needs a known role and text content (a string, or a list of text parts);
    other keys (``name``, ``tool_call_id``) are kept unless null, since Parquet structs fill
    absent fields with nulls.
    """
    if not isinstance(value, list) or not value:
        raise RowError(
            f"{where} must be a non-empty list of {{role, content}} messages, "
            f"got {type_name(value)}",
            row_id,
        )
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RowError(
                f"{where}[{i}] must be an object with role and content, got {type_name(message)}",
                row_id,
            )
        role = ALIASES.get(message.get("role"), message.get("role"))
        if role not in ROLES:
            raise RowError(
                f"{where}[{i}].role is {short_repr(message.get('role'))}; expected one of "
                f"{', '.join((*ROLES, *ALIASES))}",
                row_id,
            )
        content = _text(message.get("content"), f"{where}[{i}].content", row_id)
        kept = {k: v for k, v in message.items() if v is not None}
        messages.append({**kept, "role": role, "content": content})
    return messages


def _text(content: Any, where: str, row_id: str | None) -> str:
    """A message's content as one string: itself, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise RowError(
            f"{where} must be a string or a non-empty list of text parts, got {type_name(content)}",
            row_id,
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            shown = f"type {short_repr(kind)}" if kind is not None else type_name(part)
            raise RowError(
                f"{where}[{j}] is not a text part (got {shown}); only text parts "
                '({"type": "text", "text": ...}) are supported',
                row_id,
            )
        texts.append(part["text"])
    return "\n".join(texts)
