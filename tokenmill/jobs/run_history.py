"""RunHistory: what report.html plots, recorded while a job runs, in bounded memory.

    Progress, once a sample (~1 s) ──► sample(t, tokens, rows) ─► one point, when due:
                                         output tokens, rows done, the engines' counters
                                         (prefix cache, drafts) summed, and each replica's
                                         output tokens               (BoundedSeries: < 1000)
    runner, each result row ─────────► add_result(row) ─► prompt and output lengths
                                                           (LengthHistogram: 64 bins each)

The report's end-of-run numbers (report.json) say how a run went on the whole; the history
says how it went over time: a throughput that sagged, a cache that warmed up, a replica that
started late. Nothing here grows with the number of rows or with the run's length.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.io.rows import ResultRow
from tokenmill.jobs.bounded_series import BoundedSeries
from tokenmill.jobs.engine_counters import EngineCounters
from tokenmill.jobs.length_histogram import LengthHistogram

__all__ = ["HistoryPoint", "RunHistory", "device_of", "replica_counters"]


@dataclass(frozen=True)
class HistoryPoint:
    """The run at one moment (counts since the run started, all cumulative)."""

    output_tokens: int
    rows_done: int  # finished or failed, this run
    counters: EngineCounters  # summed over replicas
    replica_tokens: tuple[int, ...]  # per replica, in RunHistory.replicas' order


class RunHistory:
    """The run's samples and length histograms. ``counters`` gives each replica's engine
    counters by replica name (the local executor: one replica); None records no counters.
    Points are kept at least ``sample_s`` apart, fewer than ``max_points``."""

    def __init__(
        self,
        counters: Callable[[], Mapping[str, EngineCounters]] | None = None,
        sample_s: float = 1.0,
        max_points: int = 1000,
    ) -> None:
        self._counters = counters
        self._series: BoundedSeries[HistoryPoint] = BoundedSeries(sample_s, max_points)
        self.replicas: list[str] = []  # in the order they were first heard from
        self.last_counters: dict[str, EngineCounters] = {}
        self.prompt_lengths = LengthHistogram()
        self.output_lengths = LengthHistogram()

    @property
    def points(self) -> list[tuple[float, HistoryPoint]]:
        """(seconds since the model loaded, the run then), oldest first."""
        return self._series.points

    def add_result(self, row: ResultRow) -> None:
        """Count the lengths of one finished row with a completion (failed rows have none)."""
        if row.ok:
            self.prompt_lengths.add(row.prompt_tokens)
            self.output_lengths.add(row.completion_tokens)

    def sample(
        self, seconds: float, output_tokens: int, rows_done: int, last: bool = False
    ) -> None:
        """The run at ``seconds`` since the model loaded; recorded when due (``last``: the
        run's final sample, always)."""
        if not self._series.due(seconds, last):
            return
        by_replica = dict(self._counters()) if self._counters is not None else {}
        for name in by_replica:
            if name not in self.replicas:
                self.replicas.append(name)
        self.last_counters.update(by_replica)
        total = sum(self.last_counters.values(), EngineCounters())
        tokens = tuple(
            self.last_counters[r].output_tokens if r in self.last_counters else 0
            for r in self.replicas
        )
        self._series.add(seconds, HistoryPoint(output_tokens, rows_done, total, tokens), last)


def replica_counters(executor: Any) -> Callable[[], Mapping[str, EngineCounters]]:
    """What a RunHistory reads of ``executor``: each Ray replica's counters by actor id, or
    the local engine's as the one replica ``local``."""
    if hasattr(executor, "counters_by_replica"):
        return lambda: executor.counters_by_replica
    return lambda: {"local": executor.counters}


def device_of(executor: Any) -> str:
    """Where ``executor``'s engine runs, for the report: ``cpu``, ``cuda:0 (NVIDIA H200)``;
    a Ray executor's replicas run elsewhere: ``ray: 4 replicas``. Call before it closes."""
    engine = getattr(executor, "engine", None)
    if engine is None:
        return f"ray: {getattr(executor, 'replicas', 1)} replicas"
    device = engine.device
    if device.type == "cuda":
        import torch

        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
