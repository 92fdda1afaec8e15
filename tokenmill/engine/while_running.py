"""WhileRunning: a process-wide change held while at least one engine loop runs.

Some settings belong to the process, not to one engine: the garbage collector's frozen heap
(frozen_heap.py; the GIL switch interval, which spans of two kinds ask for, has its own
owner: switch_interval.py). Loops may nest (a loop inside another's callback) or run at once
in several threads; the change is made when the first starts and undone when the last ends,
whatever the order they end in:

    loop A  ├──────────────────────────┤
    loop B          ├─────────┤
            ^ apply                    ^ undo(what apply returned)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["WhileRunning"]


class WhileRunning:
    """Calling it gives a context manager (re-entrant, any thread): ``apply()`` runs when no
    other run is inside, ``undo(its result)`` when the last one leaves."""

    def __init__(self, apply: Callable[[], Any], undo: Callable[[Any], None]) -> None:
        self._apply = apply
        self._undo = undo
        self._lock = threading.Lock()
        self._runs = 0  # runs inside now, in any thread
        self._applied: Any = None  # what apply returned, for undo
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        """In a forked child no run is inside (the loops' threads stay in the parent): its
        copy of the change is undone, and its lock is new (another thread may have held
        it at the fork). The child's own runs counted the parent's, and never undid it."""
        self._lock = threading.Lock()
        if self._runs:
            self._runs = 0
            applied, self._applied = self._applied, None
            self._undo(applied)

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._runs == 0:
                self._applied = self._apply()
            self._runs += 1
        try:
            yield
        finally:
            with self._lock:
                self._runs -= 1
                if self._runs == 0:
                    applied, self._applied = self._applied, None
                    self._undo(applied)
