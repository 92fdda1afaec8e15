"""Walking an exception's chain: itself, then what caused it (``raise ... from``, or the
exception being handled when it was raised), for the checks that decide an exit code."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["in_chain"]

_DEPTH = 10  # links followed at most (a cycle, or a chain of wrappers, ends there)


def in_chain(exc: BaseException, test: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception in ``exc``'s chain that passes ``test``, if any."""
    seen: BaseException | None = exc
    for _ in range(_DEPTH):
        if seen is None:
            return None
        if test(seen):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
