"""Values as error messages name them: ``short_repr`` (a bounded repr) and ``type_name``
('expected X, got a list')."""

from __future__ import annotations

_REPR_LIMIT = 80


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
