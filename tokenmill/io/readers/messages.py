"""Checking a row's chat conversation: ``normalize_messages`` (engine/chat_messages.py, which
every entry point shares), its complaint as a RowError naming the row."""

from __future__ import annotations

from typing import Any

from tokenmill.engine.chat_messages import normalize_messages
from tokenmill.io.readers.row_error import RowError


def check_messages(value: Any, where: str, row_id: str | None) -> list[dict[str, Any]]:
    """``value`` as a list of message dicts, or RowError naming ``where`` (a column or field):
    see ``normalize_messages``."""
    try:
        return normalize_messages(value, where)
    except ValueError as exc:
        raise RowError(str(exc), row_id) from None
