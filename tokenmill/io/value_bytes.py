"""value_bytes: about how much memory a JSON-like value holds, for bounds in bytes.

The count is what the value weighs (a byte a character of text, a reference an item of a
container, a small object a scalar), not ``sys.getsizeof`` over every object: cheap next to
parsing the value, and within a small factor of it, which is all a bound needs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["value_bytes"]

_VALUE_BYTES = 32  # a number, a bool, None, a date: one small object and its reference
_ITEM_BYTES = 8  # a container's reference to each item


def value_bytes(value: Any) -> int:
    """About the bytes ``value`` (a JSON-like value: str, bytes, dict, list, tuple, scalar)
    holds: a character or byte each for text, the items' for containers. Iterative, so a
    deeply nested value cannot exhaust the stack."""
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str | bytes | bytearray):
            total += _VALUE_BYTES + len(v)
        elif isinstance(v, dict):
            total += _VALUE_BYTES + 2 * _ITEM_BYTES * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            total += _VALUE_BYTES + _ITEM_BYTES * len(v)
            stack.extend(v)
        else:
            total += _VALUE_BYTES
    return total
