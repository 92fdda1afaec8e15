"""RateWindow: the recent rate of a growing count (output tokens, rows done), from samples.

    samples  (t0, c0) (t1, c1) ... (tn, cn)          t: seconds on one clock, c: cumulative
              ▲ the last sample at or before tn - window_s; older ones are dropped
    rate  =  (cn - c0) / (tn - t0)                   once tn - t0 >= min_span_s

A window, not the whole run, so that a slow start (prefill of the first batch, a replica still
loading) stops weighing on the rate after ``window_s``. ``start_at`` moves the window's start
forward, for time that must not count (a Ray replica that loaded its model after the clock
started): the count at that moment becomes the baseline.
"""

from __future__ import annotations

from collections import deque

__all__ = ["RateWindow"]


class RateWindow:
    """Rate over the last ``window_s`` seconds of samples; None until ``min_span_s`` of them."""

    def __init__(self, window_s: float, min_span_s: float = 1.0) -> None:
        if window_s <= 0 or min_span_s < 0:
            raise ValueError(
                f"window_s must be > 0 and min_span_s >= 0, got {window_s} and {min_span_s}"
            )
        self.window_s = window_s
        self.min_span_s = min_span_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, t: float, count: float) -> None:
        """Record the cumulative ``count`` at time ``t`` (not earlier than the last sample's)."""
        if self._samples and t < self._samples[-1][0]:
            raise ValueError(f"samples must come in time order: {t} after {self._samples[-1][0]}")
        self._samples.append((t, count))
        # Keep one sample at or before the window's start, so the span covers the window.
        while len(self._samples) > 2 and self._samples[1][0] <= t - self.window_s:
            self._samples.popleft()

    def start_at(self, t: float) -> None:
        """Drop what came before ``t``: the window starts there, with the count it had then
        (the last sample at or before ``t``)."""
        base = None
        while self._samples and self._samples[0][0] <= t:
            base = self._samples.popleft()[1]
        if base is not None:
            self._samples.appendleft((t, base))

    def rate(self) -> float | None:
        """Count per second over the window; None while it spans less than ``min_span_s``."""
        if len(self._samples) < 2:
            return None
        (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
        span = t1 - t0
        if span < self.min_span_s or span <= 0:
            return None
        return (c1 - c0) / span

    def increase(self) -> float:
        """How much the count grew over the window (0 without two samples)."""
        if len(self._samples) < 2:
            return 0.0
        return self._samples[-1][1] - self._samples[0][1]
