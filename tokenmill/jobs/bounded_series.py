"""BoundedSeries: a time series of a run's samples whose memory stays bounded however long
the run lasts.

    every = e        (t0, v0) (t1, v1) ... (tn, vn)       points at least e seconds apart
    full (max_points) ─► keep every other point, every = 2e  (the span covered is unchanged)

A run of days keeps fewer than ``max_points`` points, each ``every`` seconds apart at most
twice the spacing it would have had with unbounded memory. A point at the same (rounded)
time as the last one replaces it, so a final sample after the last regular one is kept.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["BoundedSeries"]

V = TypeVar("V")


class BoundedSeries(Generic[V]):
    """Points ``(seconds, value)`` at least ``every_s`` apart, fewer than ``max_points``."""

    def __init__(self, every_s: float, max_points: int = 1000) -> None:
        if every_s <= 0 or max_points < 4:
            raise ValueError(
                f"every_s must be > 0 and max_points >= 4, got {every_s} and {max_points}"
            )
        self.every_s = every_s
        self.max_points = max_points
        self.points: list[tuple[float, V]] = []

    def due(self, seconds: float, last: bool = False) -> bool:
        """Whether ``add`` at ``seconds`` would record a point (to skip gathering its value)."""
        t = round(seconds, 2)
        return (
            last
            or not self.points
            or t - self.points[-1][0] >= self.every_s
            or (self.points[-1][0] == t)
        )

    def add(self, seconds: float, value: V, last: bool = False) -> bool:
        """Record ``value`` at ``seconds`` (rounded to 10 ms) if it is due; ``last`` records it
        whatever the spacing (the run's final sample). Returns whether it was recorded."""
        t = round(seconds, 2)
        points = self.points
        if points and points[-1][0] == t:
            points[-1] = (t, value)
            return True
        if points and t - points[-1][0] < self.every_s and not last:
            return False
        points.append((t, value))
        if len(points) >= self.max_points:
            self.points = points[::2]
            self.every_s *= 2
        return True
