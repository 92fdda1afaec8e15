"""ProgressHeartbeat: a thread that writes the progress line when a long engine step spans
the moment it is due.

    engine thread  ── step (8 s) ──┬── step (21 s) ──────────────────┬── tick: line
    heartbeat      ── every 1 s: due, and no tick for a second? ─────┴─► Progress.write_overdue

The line is written between engine steps (``Progress.tick``), and on a CPU the first steps
take seconds each: the first line came 30 s after the model loaded where README says one
comes every 10 s. The heartbeat writes it then, from the numbers of the last sample (it never
reads the engine, whose state belongs to its own thread). Log lines only: on a terminal the
bar is drawn by the engine's thread alone.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.jobs.progress import Progress

__all__ = ["ProgressHeartbeat"]


class ProgressHeartbeat:
    """Calls ``progress.write_overdue()`` every ``period_s`` seconds on a daemon thread until
    ``stop``."""

    def __init__(self, progress: Progress, period_s: float) -> None:
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self._progress = progress
        self._period_s = period_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name="tokenmill-progress-heartbeat", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(self._period_s):
            self._progress.write_overdue()

    def stop(self) -> None:
        """End the thread (idempotent); it writes nothing after this returns."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
