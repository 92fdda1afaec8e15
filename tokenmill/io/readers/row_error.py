"""RowError: why one input row is bad; the reader turns it into an error row, never a crash."""

from __future__ import annotations

from tokenmill.engine.value_text import short_repr, type_name

__all__ = ["RowError", "short_repr", "type_name"]


class RowError(ValueError):
    """A bad row. ``row_id`` is the row's own id when it was read before the problem showed."""

    def __init__(self, message: str, row_id: str | None = None) -> None:
        super().__init__(message)
        self.row_id = row_id
