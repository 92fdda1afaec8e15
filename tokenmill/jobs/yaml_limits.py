"""Bounds on a job spec's raw value, and a bounded way to show values in error messages.

A small YAML file can stand for a huge value: an anchor (``&a``) is one object however
often an alias (``*a``) repeats it, so nine lines of "billion laughs"

    a: &a [x, x, x, x, x, x, x, x, x]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
    ...                                          # 9**9 items once expanded

load in microseconds, yet validating (or printing) them walks every copy. ``find_oversize``
measures the loaded value first, walking each shared list or mapping once (memoized by id),
so even such a value is refused at once. ``show_value`` keeps every message short whatever
the value: no error message grows with the input.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

MAX_FILE_BYTES = 1 << 20  # a job.yaml is a few dozen lines
MAX_ITEMS = 100_000  # lists, mappings and scalars, each alias counted as a full copy
MAX_SHARED_USES = 100  # YAML aliases (or repeated references to one list or dict)
MAX_DEPTH = 32  # nesting of lists and mappings
MAX_SHOWN = 80  # characters of a value in an error message
MAX_KEY_PART = 40  # characters of one key in a dotted key path

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_ITEMS",
    "MAX_SHARED_USES",
    "MAX_DEPTH",
    "Oversize",
    "find_oversize",
    "dotted_key",
    "show_value",
]


@dataclass(frozen=True)
class Oversize:
    """Where a raw spec is too big: the dotted key (``<root>`` for all of it) and why."""

    key: str
    reason: str


class _Found(Exception):
    def __init__(self, found: Oversize) -> None:
        self.found = found


def find_oversize(value: Any) -> Oversize | None:
    """The first list or mapping in ``value`` that is too big, too deep or contains itself.

    Returns None when ``value`` is within ``MAX_ITEMS``, ``MAX_SHARED_USES`` and
    ``MAX_DEPTH``. Runs in time bounded by the limits, not by the expanded size.
    """
    sizes: dict[int, int] = {}  # id -> expanded size of a list or mapping walked already
    open_ids: set[int] = set()  # lists and mappings on the current path
    shared_uses = 0

    def walk(node: Any, path: tuple[Any, ...]) -> int:
        nonlocal shared_uses
        if isinstance(node, dict):
            children: Iterable[tuple[Any, Any]] = node.items()
        elif isinstance(node, (list, tuple, set, frozenset)):
            children = enumerate(node)
        else:
            return 1
        ident = id(node)
        if ident in open_ids:
            raise _Found(Oversize(dotted_key(path), "contains itself; pass plain values"))
        if ident in sizes:
            shared_uses += 1
            if shared_uses > MAX_SHARED_USES:
                reason = (
                    f"repeats a list or mapping more than {MAX_SHARED_USES} times through "
                    "YAML aliases (*name); write the values out instead"
                )
                raise _Found(Oversize(dotted_key(path), reason))
            return sizes[ident]
        if len(path) >= MAX_DEPTH:
            reason = f"is nested more than {MAX_DEPTH} lists or mappings deep"
            raise _Found(Oversize(dotted_key(path), reason))
        open_ids.add(ident)
        total = 1
        for key, child in children:
            total += walk(child, (*path, key))
            if isinstance(node, dict):
                total += 1  # the key itself
            if total > MAX_ITEMS:
                reason = (
                    f"expands to over {MAX_ITEMS:,} values (each YAML alias *name counts as "
                    "a full copy); a job spec needs far fewer"
                )
                raise _Found(Oversize(dotted_key(path), reason))
        open_ids.discard(ident)
        sizes[ident] = total
        return total

    try:
        walk(value, ())
    except _Found as found:
        return found.found
    return None


def dotted_key(path: Iterable[Any]) -> str:
    """``("sampling", "stop", 3)`` -> ``"sampling.stop.3"``, each part cut to a few words."""
    parts = []
    for part in path:
        text = part if isinstance(part, str) else show_value(part)
        if len(text) > MAX_KEY_PART:
            text = text[: MAX_KEY_PART - 3] + "..."
        parts.append(text)
    return ".".join(parts) or "<root>"


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr, without the sort of a whole dict or set first."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxdict = self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = 5
        self.maxstring = self.maxlong = self.maxother = MAX_SHOWN

    def repr_dict(self, x: dict, level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [
            f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
            for k, v in islice(x.items(), self.maxdict)
        ]
        if len(x) > self.maxdict:
            pieces.append("...")
        return "{" + ", ".join(pieces) + "}"

    def repr_set(self, x: set, level: int) -> str:
        if not x:
            return "set()"
        return self._repr_iterable(list(islice(x, self.maxset + 1)), level, "{", "}", self.maxset)

    def repr_frozenset(self, x: frozenset, level: int) -> str:
        if not x:
            return "frozenset()"
        items = list(islice(x, self.maxset + 1))
        return self._repr_iterable(items, level, "frozenset({", "})", self.maxset)

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 256:  # str() of a huge int is slow, past 4300 digits an error
            return f"<a {x.bit_length()}-bit integer>"
        return super().repr_int(x, level)


_SHORT_REPR = _ShortRepr()


def show_value(value: Any) -> str:
    """``value`` for an error message, at most ``MAX_SHOWN`` characters whatever its size.

    YAML spelling for ``true``, ``false`` and ``null``; a cut repr for anything else.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    try:
        text = _SHORT_REPR.repr(value)
    except Exception:  # a user object whose __repr__ fails must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."
