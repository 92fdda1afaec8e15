"""Checking chat conversations: a non-empty list of {role, content} messages."""

from __future__ import annotations

from typing import Any

from tokenmill.io.readers.row_error import RowError, short_repr, type_name

ROLES = ("system", "user", "assistant", "tool")


def check_messages(value: Any, where: str, row_id: str | None) -> list[dict[str, Any]]:
    """``value`` as a list of message dicts, or RowError naming ``where`` (a column or field).

    Each message needs a known role and string content; other keys (``name``,
    ``tool_call_id``) are kept unless null, since Parquet structs fill absent fields with nulls.
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
        role = message.get("role")
        if role not in ROLES:
            raise RowError(
                f"{where}[{i}].role is {short_repr(role)}; expected one of {', '.join(ROLES)}",
                row_id,
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise RowError(
                f"{where}[{i}].content must be a string (only text content is supported), "
                f"got {type_name(content)}",
                row_id,
            )
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages
