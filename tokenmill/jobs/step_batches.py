"""StepBatches: how many rows an engine held at each of its steps, as a histogram.

An executor tops its engine up to ``2 * max_num_seqs`` rows before every step, so a step
holding fewer than ``max_num_seqs`` rows ran a batch below full: the engine was waiting for
input (a drained batch). Only the job's last steps should look like that; anything else means
the feed let the engine drain (a Ray replica emptied between chunks, a slow reader). Read by
the executors' ``on_step`` hook (rows in flight as the step ran), kept as {rows: steps} so it
stays small however long the job.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["StepBatches"]


@dataclass
class StepBatches:
    """{rows the engine held: steps}. Adds up over replicas (``+``)."""

    counts: Counter[int] = field(default_factory=Counter)

    def add(self, rows: int) -> None:
        self.counts[rows] += 1

    def __add__(self, other: StepBatches) -> StepBatches:
        return StepBatches(self.counts + other.counts)

    def copy(self) -> StepBatches:
        return StepBatches(Counter(self.counts))

    @property
    def steps(self) -> int:
        return sum(self.counts.values())

    @property
    def mean(self) -> float:
        """Mean rows held per step (0 before the first step)."""
        steps = self.steps
        return sum(rows * n for rows, n in self.counts.items()) / steps if steps else 0.0

    def steps_below(self, rows: int) -> int:
        """Steps that held fewer than ``rows`` rows."""
        return sum(n for held, n in self.counts.items() if held < rows)
