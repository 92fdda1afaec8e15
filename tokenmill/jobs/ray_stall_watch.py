"""StallWatch: tells a hung replica from a slow one, by whether its engine still steps.

A replica whose engine hangs (a deadlocked collective, a wedged GPU, a native call that
never returns) neither finishes its chunks nor dies, so without a watch the job would wait
forever. While a replica holds rows, the driver asks it for its engine's step count
(``EngineReplica.steps``, answered on a thread of its own) every ``interval_s``; a replica
whose count has not moved for ``timeout_s`` seconds, or that does not answer for that long,
is stalled: the pool kills it and its rows run again like those of a replica that died
(ray_chunks.py isolates a row that hangs every replica it runs on). A long generation is
not a stall: each decode step moves the count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError

__all__ = ["StallWatch"]

log = logging.getLogger("tokenmill.jobs")

_MAX_INTERVAL_S = 10.0  # how often a busy replica is asked, at most


@dataclass
class StallWatch:
    """One replica's watch. ``check`` runs at every poll of a replica holding rows; call
    ``reset`` when it starts holding rows again, and when a new actor takes its place."""

    timeout_s: float
    steps: int = -1  # the last count the replica gave (-1: none yet)
    moved_at: float = 0.0  # monotonic: when the count last moved, or the watch was reset
    asked: Any = None  # ObjectRef of the steps() call in flight
    asked_at: float = 0.0

    @property
    def interval_s(self) -> float:
        return min(self.timeout_s / 4, _MAX_INTERVAL_S)

    def reset(self, now: float) -> None:
        self.steps, self.moved_at, self.asked = -1, now, None

    def stalled(self, actor: Any, now: float) -> bool:
        """Reads the answer to the last question, asks again when it is time; True once
        the count has not moved for ``timeout_s``."""
        if self.asked is not None:
            ready, _ = ray.wait([self.asked], timeout=0)
            if ready:
                try:
                    steps = ray.get(ready[0])
                except RayError as exc:  # the replica failed: its chunks' calls say how
                    log.debug("a replica's step count: %s", type(exc).__name__)
                    steps = self.steps
                if steps != self.steps:
                    self.steps, self.moved_at = steps, now
                self.asked = None
        if self.asked is None and now - self.asked_at >= self.interval_s:
            self.asked, self.asked_at = actor.steps.remote(), now
        return now - self.moved_at > self.timeout_s
