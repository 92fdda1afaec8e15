"""PlannerSettings: how the dataset planner orders, deduplicates and routes a job's rows.

job.yaml's ``planner`` section (tokenmill/jobs/spec.py) holds the same keys; no setting
changes any row's result, so they are not in the job fingerprint and may change between a
run and its resume.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_WINDOW", "ROUTINGS", "PlannerSettings"]

MAX_WINDOW = 1_000_000  # rows held to reorder; past this the memory, not the tail, matters
ROUTINGS = ("prefix", "balance")  # planner.routing's values


@dataclass(frozen=True)
class PlannerSettings:
    """``order``: ``length`` hands rows to the engine longest predicted work first within
    ``window`` rows (work_estimate.py), ``input`` in input order. ``window``: the rows held
    to reorder, also the bound on rows held for a twin and on results kept for later twins.
    ``dedup``: rows identical to another (same prompt, same reproducible sampling) are
    computed once (dedup.py). ``routing`` (the Ray executor with several replicas): which
    replica runs a row; ``prefix`` by its leading prompt text (prefix_router.py), so that
    rows sharing a system prompt share one replica's prefix cache, ``balance`` to the
    replica with the fewest rows queued and running, in whole chunks.

    All are on by default: none changes a result (greedy and seeded rows only are
    deduplicated; reordering and routing change which rows share a batch, as a different
    ``max_num_seqs`` or a slower reader already does), and they cost a hash and a heap
    operation a row. Raises ValueError naming the key."""

    order: str = "length"
    window: int = 2048
    dedup: bool = True
    routing: str = "prefix"

    def __post_init__(self) -> None:
        if self.order not in ("length", "input"):
            raise ValueError(f"planner.order must be 'length' or 'input', got {self.order!r}")
        window = self.window
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
            raise ValueError(
                f"planner.window must be an integer in [1, {MAX_WINDOW}], got {window!r}"
            )
        if not isinstance(self.dedup, bool):
            raise ValueError(f"planner.dedup must be true or false, got {self.dedup!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"planner.routing must be 'prefix' or 'balance', got {self.routing!r}")

    @property
    def by_length(self) -> bool:
        return self.order == "length"

    @property
    def by_prefix(self) -> bool:
        return self.routing == "prefix"
