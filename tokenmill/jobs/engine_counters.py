"""EngineCounters: what a job reports from its engines' running counts, summed over replicas.

Each replica's engine counts from its start; an executor keeps the latest counts of each
replica (a Ray replica sends them with every chunk it returns) and adds them up. Every count
only grows, so the sum over replicas is the job's count whatever the replicas' timing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from tokenmill.engine.core.scheduler_output import draft_summary

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import LLMEngine

__all__ = ["EngineCounters"]


@dataclass(frozen=True)
class EngineCounters:
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of which found cached
    draft_tokens: int = 0  # speculative drafts scheduled
    accepted_tokens: int = 0  # drafts accepted: decode steps saved
    drafted_rows: int = 0  # (step, row) pairs that carried drafts
    # Output tokens generated so far, rows still generating included (what a live rate counts)
    output_tokens: int = 0
    # Rows put back in the queue, their KV freed and recomputed later, for want of free KV
    # blocks: a job that does this often runs at a fraction of its speed with no other sign
    preemptions: int = 0

    @classmethod
    def of(cls, engine: LLMEngine, output_tokens: int = 0) -> EngineCounters:
        """The counts of ``engine``; ``output_tokens`` is the caller's (the engine counts
        only its unfinished requests' tokens: see RowProcessor.output_tokens)."""
        prefix = engine.scheduler.kv.prefix_cache_stats
        steps = engine.scheduler.stats
        return cls(
            prefix.queried_tokens,
            prefix.hit_tokens,
            steps.num_draft_tokens,
            steps.num_accepted_tokens,
            steps.num_drafted_rows,
            output_tokens,
            steps.num_preemptions,
        )

    def __add__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(
            *(getattr(self, f.name) + getattr(other, f.name) for f in fields(self))
        )

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_queried_tokens
        return round(self.prefix_hit_tokens / q, 4) if q else 0.0

    def speculative(self, method: str) -> dict[str, float | int | str]:
        """The report's ``speculative`` entry for a job run with ``method``."""
        counts = draft_summary(self.draft_tokens, self.accepted_tokens, self.drafted_rows)
        return {"method": method, **counts}

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
