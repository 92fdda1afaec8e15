"""SwitchInterval: the one owner of the GIL switch interval (``sys.setswitchinterval``).

Spans that want shorter GIL turns (an engine loop's ``short_gil_turns``, a proposer's wait
for the device, ``brief_gil_turns``) nest and overlap, in one thread or several. Each used
to put back the interval it found, so a span that ended inside another's, or after it,
put back the other's setting: 20 us or 0.5 ms turns stayed for the rest of the process, or
a loop ran with the default 5 ms. Here every open span names its ceiling; the interval is
the shortest of them (never longer than the one found), and the one found before the first
span is put back once the last ends, whatever the order:

    loop A   short ├───────────────────────────────┤
    thread Y brief         ├─────────────┤
    interval  found │ 0.5 ms│    20 us    │ 0.5 ms │ found
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["SWITCH_INTERVAL", "SwitchInterval"]


class SwitchInterval:
    """The process's switch interval, set while spans ask for a ceiling (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ceilings: dict[int, float] = {}  # open spans: token -> seconds they allow
        self._found = 0.0  # the interval before the first open span, put back after the last
        self._tokens = itertools.count()
        os.register_at_fork(after_in_child=self._forked)

    @contextmanager
    def at_most(self, seconds: float) -> Iterator[None]:
        """The interval at most ``seconds`` inside the block (process-wide). A shorter
        interval, set before the first span or asked by another open span, is kept."""
        with self._lock:
            if not self._ceilings:
                self._found = sys.getswitchinterval()
            token = next(self._tokens)
            self._ceilings[token] = seconds
            self._apply()
        try:
            yield
        finally:
            with self._lock:
                if self._ceilings.pop(token, None) is not None:  # (None: forked since)
                    self._apply()

    def _apply(self) -> None:
        """Set the interval the open spans ask for, or the one found once none is open."""
        wanted = min([self._found, *self._ceilings.values()])
        if sys.getswitchinterval() != wanted:
            sys.setswitchinterval(wanted)

    def _forked(self) -> None:
        """In a forked child no span is open (their threads stay in the parent): the
        interval found is put back, and the lock is new (another thread may have held it
        at the fork). A span of the parent's that ends in the child changes nothing."""
        self._lock = threading.Lock()
        if self._ceilings:
            self._ceilings.clear()
            sys.setswitchinterval(self._found)


# The process's one owner of the interval (short_gil_turns.py).
SWITCH_INTERVAL = SwitchInterval()
