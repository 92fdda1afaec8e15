"""The dataset planner on a job's rows: what RowFeed asks of tokenmill/scheduling/.

    reader thread:  RowFacts(row) ─► (predicted work, dedup key)        (the per-row work)
    engine thread:  PlannedRows.add(row, facts) ─► a copy of a twin's result, held for a
                    twin still running, or queued in the ReorderWindow
                    PlannedRows.take(n) ─► rows for the engine, longest work first
                    PlannedRows.finished(result) ─► copies for the rows held for it

A row's facts are computed where it is prepared (the reader thread): hashing its prompt and
its sampling parameters costs microseconds a row that the engine thread does not pay. A
row not prepared here (a Ray driver hands rows to replicas that tokenize them) is keyed by
its text and its work estimated from it (work_estimate.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.ready_rows import ReadyRow
from tokenmill.jobs.requests import sampling_params_for
from tokenmill.jobs.row_source import FeedItem, row_index_of
from tokenmill.scheduling.dedup import (
    HELD,
    Cached,
    DedupKeys,
    Deduplicator,
    copy_result,
    text_prompt_bytes,
    token_prompt_bytes,
)
from tokenmill.scheduling.planner_settings import PlannerSettings
from tokenmill.scheduling.reorder_window import ReorderWindow
from tokenmill.scheduling.work_estimate import estimated_prompt_tokens, predicted_steps

__all__ = ["FeedPlan", "Facts", "PlannedRows", "RowFacts"]

Facts = tuple[float, bytes | None]  # (predicted work, dedup key or None)
_FAILED: Facts = (math.inf, None)  # a row that failed while prepared: written first, alone


@dataclass(frozen=True)
class FeedPlan:
    """How a RowFeed plans its rows: ``settings`` (order, window, dedup), the job's sampling
    section (the parameters of rows not prepared here) and the engine's prefill tokens a
    step (``max_num_batched_tokens``: the work estimate's prompt share)."""

    settings: PlannerSettings = field(default_factory=PlannerSettings)
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    prefill_tokens_per_step: int = 8192


class RowFacts:
    """Callable: a feed item in, its Facts out (on the reader thread; one per feed)."""

    def __init__(self, plan: FeedPlan) -> None:
        self.plan = plan
        self._defaults = dict(plan.sampling_defaults)
        self._keys = DedupKeys()

    def __call__(self, item: FeedItem) -> Facts:
        if isinstance(item, ResultRow):
            return _FAILED
        if isinstance(item, ReadyRow):
            prompt_tokens, params = len(item.prompt_ids), item.params
        elif item.prompt_token_ids is not None:
            prompt_tokens, params = len(item.prompt_token_ids), self._params_of(item)
        else:
            text = item.prompt if item.messages is None else repr(item.messages)
            prompt_tokens, params = estimated_prompt_tokens(text or ""), self._params_of(item)
        settings = self.plan.settings
        work = 0.0
        if settings.by_length:
            max_tokens = params.max_tokens if params is not None else 1
            work = predicted_steps(prompt_tokens, max_tokens, self.plan.prefill_tokens_per_step)
        key = None
        if settings.dedup and params is not None:
            if isinstance(item, ReadyRow):
                key = self._keys.key(token_prompt_bytes(item.prompt_ids), params)
            else:
                key = self._keys.key(text_prompt_bytes(item), params)
        return work, key

    def _params_of(self, row: InputRow) -> SamplingParams | None:
        """An unprepared row's sampling parameters; None when they are invalid (the replica
        that runs it reports that)."""
        try:
            return sampling_params_for(row, self._defaults)
        except Exception:
            return None


class PlannedRows:
    """The rows between the reader and the engine, on the engine thread: a ReorderWindow
    and, with dedup, a Deduplicator. Without a plan: input order, no dedup (a FIFO).
    ``nbytes``: the bytes the rows queued or held for a twin hold (as ``add`` was told)."""

    def __init__(self, plan: FeedPlan | None) -> None:
        settings = plan.settings if plan is not None else PlannerSettings("input", 1, False)
        self._window: ReorderWindow[FeedItem] = ReorderWindow(settings.window, settings.by_length)
        # rows to gather before handing any out: the window, when it reorders
        self.gather = settings.window if settings.by_length else 0
        self._dedup: Deduplicator[InputRow, ResultRow] | None = None
        if settings.dedup:
            self._dedup = Deduplicator(max_held=settings.window, max_cached=settings.window)
        self._sizes: dict[int, int] = {}  # row index -> bytes, of the rows queued or held
        self.nbytes = 0

    def __len__(self) -> int:
        """Rows queued for the engine (rows held for a twin not counted)."""
        return len(self._window)

    def add(self, item: FeedItem, facts: Facts, nbytes: int = 0) -> ResultRow | None:
        """Queue ``item`` (the next in input order, holding ``nbytes``); or, when a twin's
        result serves it, return its copy of that result (the row need not run)."""
        work, key = facts
        if key is not None and self._dedup is not None and not isinstance(item, ResultRow):
            row = item.row if isinstance(item, ReadyRow) else item
            claim = self._dedup.claim(key, row.row_index, row)
            if claim is HELD:
                self._hold(row.row_index, nbytes)
                return None
            if isinstance(claim, Cached):
                return copy_result(claim.result, row)
        self._hold(row_index_of(item), nbytes)
        self._window.push(item, work)
        return None

    def take(self, n: int) -> list[FeedItem]:
        """Up to ``n`` queued rows, in the plan's order."""
        items = self._window.pop_many(n)
        for item in items:
            self._release(row_index_of(item))
        return items

    def finished(self, result: ResultRow) -> list[ResultRow]:
        """The engine's ``result`` for a row: copies of it for the rows held as its twins."""
        if self._dedup is None:
            return []
        # cached for later twins without its passthrough values (a copy takes its own row's):
        # 2,048 results of a 5 MB column each held 10 GB (an audit)
        kept = replace(result, passthrough={}) if result.passthrough else result
        twins = self._dedup.finished(result.row_index, kept)
        copies = [copy_result(result, row) for row in twins]
        for copy in copies:
            self._release(copy.row_index)
        return copies

    def _hold(self, row_index: int, nbytes: int) -> None:
        self._sizes[row_index] = nbytes
        self.nbytes += nbytes

    def _release(self, row_index: int) -> None:
        self.nbytes -= self._sizes.pop(row_index, 0)
