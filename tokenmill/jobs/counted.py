"""counted: a count and its noun for a message, in the singular for one ("holds 1 files")."""

from __future__ import annotations

__all__ = ["counted"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 file``, ``3 files``, ``1,204 shards``: ``n`` with ``noun``, or with ``plural``
    (default: ``noun`` and an s) unless ``n`` is 1."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
