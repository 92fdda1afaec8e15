"""RowFeed: the job's input, read and prepared ahead of the engine on a reader thread.

    reader thread                                     engine thread (the runner's)
    PeekableInput.rows ─► skip committed shards       take(n) ─► shard tracker: row seen
      (their rows read for their ids alone)
      ─► batches of ``batch_rows`` ─► prepare           ├─► bad row: its error result at once
         (or batch_bytes)                              └─► ready rows, to the executor
         (template + one batch encode)
      ─► ReadAhead queue (read_ahead_rows, read_ahead_bytes at most) ──►

Row order, ids and bad-row checks are the reader's, as before; what moved off the engine
thread is the work (parsing, templating, tokenizing). The shard tracker and the progress
bar are touched only by the engine thread, in input order, so shard completion is decided
exactly as in a serial run. An error of the reader (the input cannot be read) is re-raised
by ``take`` once the rows before it are taken.

With a FeedPlan (job.yaml's ``planner`` section: tokenmill/scheduling/) the ready rows wait
in a window before ``take`` hands them out:

    rows seen by the tracker, in input order
      ─► dedup: a row identical to one queued, running or recently finished is held (its
         copy is written when that one's result comes: ``finished``) or copied at once
      ─► ReorderWindow (``window`` rows): longest predicted work first, each row at most
         ``window`` rows later than input order ─► take(n)

Each bound in rows has one in bytes beside it (pipeline_bounds.py, row_bytes.py), so that wide
rows are not held by the thousand: a ``take`` stops reading once the rows queued or held
here and those it read hold ``window_bytes`` and one of them is queued (rows held for a
twin that runs cannot be handed out: on their weight alone a take returned nothing while
the input had rows left).

Exactly once is unchanged: a row's shard is fixed by its row index whatever the order it
runs in, the tracker has seen every row before it runs, and a shard is complete only when
each row it saw has a result (a held row's copy included); rows held or queued when a run
stops have none, so their shards are recomputed on resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.readers import IdOnlyRow, InputConfig, RowPredicate
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.peekable_input import PeekableInput
from tokenmill.jobs.pipeline_bounds import PipelineBounds
from tokenmill.jobs.planned_rows import Facts, FeedPlan, PlannedRows, RowFacts
from tokenmill.jobs.progress import Progress
from tokenmill.jobs.read_ahead import ReadAhead
from tokenmill.jobs.ready_rows import ReadyRow
from tokenmill.jobs.requests import error_result
from tokenmill.jobs.row_bytes import input_row_bytes, item_bytes
from tokenmill.jobs.row_estimate import RowTotal
from tokenmill.jobs.row_source import FeedItem, Prepare, row_index_of
from tokenmill.jobs.shard_tracker import ShardTracker

__all__ = ["FeedPlan", "RowFeed"]

# Rows one ``take`` reads at most (beyond its gather): bounds the rows held, and the wait
# before a cancel is seen, on a stretch of input the engine gets none of.
TAKE_READ_ROWS = 4096
_WAIT_S = 0.1  # how long a waiting ``take`` blocks before its caller re-checks ``cancel``
_NO_FACTS: Facts = (0.0, None)  # without a plan: no work to sort by, no dedup key


@dataclass(frozen=True)
class _FeedBatch:
    items: list[FeedItem]  # in input order; bad InputRows included
    rows_read: int  # input rows this batch accounts for, skipped ones included
    sizes: list[int]  # each item's bytes (row_bytes.py)
    facts: list[Facts] | None = None  # each good item's (work, dedup key), with a plan

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


class RowFeed:
    """The rows of ``cfg`` not in ``committed`` shards; a RowSource, and iterable (blocking).

    ``prepare`` (run on the reader thread) turns good rows into ReadyRows; without it, good
    rows are handed over as they are. With ``schema`` (the job's Parquet output schema), a
    row whose passthrough values do not fit it is a bad row. Without ``plan``, rows are
    handed over in input order and none is deduplicated. ``rows_read`` counts the rows
    taken so far (those of committed shards, skipped, included), ``rows_deduplicated`` the
    rows given a copy of an identical row's result and ``deduplicated_tokens`` their prompt
    and completion tokens (the engine's work saved). Call ``finished`` with each result the
    executor gives, and ``close`` when done (it stops the reader).

    The rows are read through ``source`` (a PeekableInput of ``cfg`` and ``schema``; a fresh
    one when left out), the job's one read of its input: the first rows a fresh job sized
    its shards from (shard_size.py) are not read again.

    Rows that need no engine (bad rows, copies for duplicates) go to the tracker as results
    while ``take`` reads; ``on_results`` is called after a ``take`` that gave it some, so
    that their shards are committed then, not when the engine next returns a result. A
    ``take`` reads at most ``TAKE_READ_ROWS`` rows (or its gather, if more), whatever it
    found: on an input of bad rows it returns, empty, for its caller to see a cancel.
    """

    def __init__(
        self,
        cfg: InputConfig,
        committed: frozenset[int],
        tracker: ShardTracker,
        progress: Progress,
        model: str,
        prepare: Prepare | None,
        bounds: PipelineBounds,
        schema: OutputSchema | None = None,
        plan: FeedPlan | None = None,
        on_results: Callable[[], None] | None = None,
        source: PeekableInput | None = None,
    ) -> None:
        if source is not None and (source.cfg is not cfg or source.schema != schema):
            raise ValueError("RowFeed: source reads another input or schema than the feed's")
        self._tracker = tracker
        self._on_results = on_results
        self._progress = progress
        self._model = model
        self._batch_rows = bounds.batch_rows
        self._window_bytes = bounds.window_bytes
        self._ready = PlannedRows(plan)
        self._input_done = False
        self.rows_read = 0
        self._direct = 0  # results given to the tracker without the engine
        self._copies: dict[int, tuple[int, int]] = {}  # shard -> copies' (rows, tokens)
        facts = RowFacts(plan) if plan is not None else None
        rows = (source if source is not None else PeekableInput(cfg, schema)).rows
        batches = _read(rows, committed, tracker.rows_per_shard, prepare, bounds, facts)
        self._ahead: ReadAhead[_FeedBatch] = ReadAhead(
            batches,
            bounds.read_ahead_batches,
            name="tokenmill-reader",
            size_of=lambda batch: batch.nbytes,
            max_bytes=bounds.read_ahead_bytes,
        )

    @property
    def exhausted(self) -> bool:
        return self._input_done and not self._ready

    def take(self, max_rows: int, wait: bool) -> list[FeedItem]:
        """Up to ``max_rows`` good rows (ReadyRow | ResultRow | InputRow) in input order, or
        in the plan's order; see RowSource. Marks each row seen by the tracker; bad rows go
        to it as results here, and so do copies for duplicates of finished rows."""
        gather = max(max_rows, self._ready.gather)
        budget = self.rows_read + max(gather, TAKE_READ_ROWS)
        held = self._ready.nbytes  # queued and held rows, then what this take reads
        direct = self._direct
        while len(self._ready) < gather and not self._input_done:
            if self.rows_read >= budget:
                break  # bad rows and copies only so far: hand them on
            if held >= self._window_bytes and len(self._ready):
                break  # wide rows: hand on those queued (rows held for a twin are not)
            batch = self._ahead.get(_WAIT_S if wait and not self._ready else 0.0)
            if batch is None:
                if self._ahead.exhausted:
                    self._input_done = True
                    self._tracker.input_done()
                    # read to its end: the input's rows are known, an estimate's no more
                    self._progress.set_total(RowTotal(self.rows_read, estimated=False))
                break
            self._accept(batch)
            held += batch.nbytes
        if self._direct != direct and self._on_results is not None:
            self._on_results()
        return self._ready.take(max_rows)

    def finished(self, result: ResultRow) -> None:
        """The executor's ``result`` for a row: the rows held as its duplicates get their
        copies of it (to the tracker, as results)."""
        for copy in self._ready.finished(result):
            self._add_copy(copy)

    @property
    def rows_deduplicated(self) -> int:
        return self.deduplicated_in(self._copies)[0]

    @property
    def deduplicated_tokens(self) -> int:
        return self.deduplicated_in(self._copies)[1]

    def __iter__(self) -> Iterator[FeedItem]:
        while not self.exhausted:
            yield from self.take(self._batch_rows, wait=True)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the reader (waiting up to ``timeout`` seconds for it)."""
        self._ahead.close(timeout)

    def _accept(self, batch: _FeedBatch) -> None:
        self.rows_read += batch.rows_read
        for i, item in enumerate(batch.items):
            self._tracker.row_seen(row_index_of(item))
            if isinstance(item, InputRow) and item.error is not None:
                self._tracker.add_result(error_result(item, item.error, self._model))
                self._progress.update(1, 0)
                self._direct += 1
                continue
            facts = batch.facts[i] if batch.facts else _NO_FACTS
            copy = self._ready.add(item, facts, batch.sizes[i])
            if copy is not None:
                self._add_copy(copy)

    def deduplicated_in(self, shards: Iterable[int]) -> tuple[int, int]:
        """(rows, tokens) of the copies made for rows of ``shards``: a stopped run's report
        counts the copies it committed, not those dropped with incomplete shards."""
        counts = [self._copies.get(shard, (0, 0)) for shard in shards]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def _add_copy(self, copy: ResultRow) -> None:
        """A row's copy of its duplicate's result, as its result. Only copied completions
        count as deduplicated (work saved): a copied error saved nothing, and whether a
        failing row's twin is held for a copy depends on where rows are prepared (the Ray
        driver keys them by text before any check; locally they fail first)."""
        if copy.error is None:
            shard = self._tracker.shard_of(copy.row_index)
            rows, tokens = self._copies.get(shard, (0, 0))
            # the engine's work spared: every token it would generate, best_of's left-out
            # samples included (completion_tokens counts the returned ones only: an audit)
            spared = copy.prompt_tokens + max(copy.generated_tokens, copy.completion_tokens)
            self._copies[shard] = (rows + 1, tokens + spared)
        self._tracker.add_result(copy)
        self._direct += 1
        self._progress.update(1, 0)  # no engine tokens: the rates count the engine's work


def _read(
    input_rows: Callable[[RowPredicate | None], Iterator[InputRow | IdOnlyRow]],
    committed: frozenset[int],
    rows_per_shard: int,
    prepare: Prepare | None,
    bounds: PipelineBounds,
    facts_of: Callable[[FeedItem], Facts] | None,
) -> Iterator[_FeedBatch]:
    """The reader thread's work: the input (``input_rows``, opened here, on the reader
    thread) in batches (``bounds.batch_rows`` rows, or fewer
    holding ``bounds.batch_bytes``), committed shards skipped (their rows read for their ids
    alone: later rows' duplicates), good rows prepared and, with ``facts_of``, planned. The
    last batch carries the counts of the rows after the last item."""

    def in_committed(row_index: int) -> bool:
        return row_index // rows_per_shard in committed

    rows: list[InputRow] = []
    sizes: list[int] = []
    read = 0
    for row in input_rows(in_committed if committed else None):
        read += 1
        if isinstance(row, IdOnlyRow) or in_committed(row.row_index):
            continue
        rows.append(row)
        sizes.append(input_row_bytes(row))
        if len(rows) == bounds.batch_rows or sum(sizes) >= bounds.batch_bytes:
            yield _batch(rows, sizes, prepare, facts_of, read)
            rows, sizes, read = [], [], 0
    yield _batch(rows, sizes, prepare, facts_of, read)


def _batch(
    rows: list[InputRow],
    row_sizes: list[int],
    prepare: Prepare | None,
    facts_of: Callable[[FeedItem], Facts] | None,
    read: int,
) -> _FeedBatch:
    """``rows`` prepared, sized and, with ``facts_of``, planned (bad rows get no facts)."""
    items = _prepared(rows, prepare)
    sizes = [item_bytes(item, n) for item, n in zip(items, row_sizes, strict=True)]
    facts = None
    if facts_of is not None:
        facts = [_NO_FACTS if _bad(item) else facts_of(item) for item in items]
    return _FeedBatch(items, read, sizes, facts)


def _bad(item: FeedItem) -> bool:
    return isinstance(item, InputRow) and item.error is not None


def _prepared(rows: list[InputRow], prepare: Prepare | None) -> list[FeedItem]:
    """``rows`` with each good row replaced by what ``prepare`` makes of it; bad rows kept."""
    good = [r for r in rows if r.error is None]
    if prepare is None or not good:
        return list(rows)
    ready: Iterator[ReadyRow | ResultRow] = iter(prepare(good))
    return [row if row.error is not None else next(ready) for row in rows]
