"""Values as error messages name them: ``short_repr`` (a bounded repr), ``type_name``
('expected X, got a list'), and ``kind_name`` (the type alone, for values never shown)."""

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


def kind_name(value: object) -> str:
    """``type_name`` without the value itself (``a number``, not ``the number 5``), for
    values an error must not echo (storage options may hold credentials)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return type_name(value)
