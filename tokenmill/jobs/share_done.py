"""The share of a job's rows done, as the progress line and the bar print it."""

from __future__ import annotations

__all__ = ["percent_done"]


def percent_done(done: int, total: int) -> int:
    """``done`` of ``total`` rows in whole percent, rounded down: rounded to nearest, 1,995
    of 2,000 rows read 100% with rows still to run, and 100% is what says "done"."""
    return min(100 * done // total, 100) if total > 0 else 0
