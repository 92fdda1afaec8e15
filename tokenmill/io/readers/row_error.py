"""RowError: why one input row is bad; the reader turns it into an error row, never a crash."""

from __future__ import annotations

_REPR_LIMIT = 80


class RowError(ValueError):
    """A bad row. ``row_id`` is the row's own id when it was read before the problem showed."""

    def __init__(self, message: str, row_id: str | None = None) -> None:
        super().__init__(message)
        self.row_id = row_id


def short_repr(value: object) -> str:
    """``repr(value)``, cut to a readable length for error messages."""
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."


def type_name(value: object) -> str:
    """The JSON-ish name of a value's type, for 'expected X, got Y' messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return "a string" if value else "an empty string"
    if isinstance(value, (list, tuple)):
        return "a list" if value else "an empty list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
