"""RowFeed: the job's input, read and prepared ahead of the engine on a reader thread.

    reader thread                                     engine thread (the runner's)
    iter_input_rows ─► skip committed shards          take(n) ─► shard tracker: row seen
      ─► batches of ``batch_rows`` ─► prepare           ├─► bad row: its error result at once
         (template + one batch encode)                 └─► ready rows, to the executor
      ─► ReadAhead queue (read_ahead_rows at most) ──►

Row order, ids and bad-row checks are the reader's, as before; what moved off the engine
thread is the work (parsing, templating, tokenizing). The shard tracker and the progress
bar are touched only by the engine thread, in input order, so shard completion is decided
exactly as in a serial run. An error of the reader (the input cannot be read) is re-raised
by ``take`` once the rows before it are taken.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.readers import InputConfig, iter_input_rows
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.pipeline_bounds import PipelineBounds
from tokenmill.jobs.progress import Progress
from tokenmill.jobs.read_ahead import ReadAhead
from tokenmill.jobs.ready_rows import ReadyRow
from tokenmill.jobs.requests import error_result
from tokenmill.jobs.row_source import FeedItem, Prepare
from tokenmill.jobs.shard_tracker import ShardTracker

__all__ = ["RowFeed"]

_WAIT_S = 0.1  # how long a waiting ``take`` blocks before its caller re-checks ``cancel``


@dataclass(frozen=True)
class _FeedBatch:
    items: list[FeedItem]  # in input order; bad InputRows included
    rows_read: int  # input rows this batch accounts for, skipped ones included
    rows_resumed: int  # of which in shards committed by an earlier run


def _row_index(item: FeedItem) -> int:
    return item.row.row_index if isinstance(item, ReadyRow) else item.row_index


class RowFeed:
    """The rows of ``cfg`` not in ``committed`` shards; a RowSource, and iterable (blocking).

    ``prepare`` (run on the reader thread) turns good rows into ReadyRows; without it, good
    rows are handed over as they are. With ``schema`` (the job's Parquet output schema), a
    row whose passthrough values do not fit it is a bad row. ``rows_read`` and
    ``rows_resumed`` count the rows taken so far. Call ``close`` when done (it stops the
    reader).
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
    ) -> None:
        self._tracker = tracker
        self._progress = progress
        self._model = model
        self._batch_rows = bounds.batch_rows
        self._ready: deque[FeedItem] = deque()
        self._input_done = False
        self.rows_read = 0
        self.rows_resumed = 0
        batches = _read(cfg, committed, tracker.rows_per_shard, prepare, bounds.batch_rows, schema)
        self._ahead: ReadAhead[_FeedBatch] = ReadAhead(
            batches, bounds.read_ahead_batches, name="tokenmill-reader"
        )

    @property
    def exhausted(self) -> bool:
        return self._input_done and not self._ready

    def take(self, max_rows: int, wait: bool) -> list[FeedItem]:
        """Up to ``max_rows`` good rows (ReadyRow | ResultRow | InputRow) in input order; see
        RowSource. Marks each row seen by the tracker; bad rows go to it as results here."""
        while len(self._ready) < max_rows and not self._input_done:
            batch = self._ahead.get(_WAIT_S if wait and not self._ready else 0.0)
            if batch is None:
                if self._ahead.exhausted:
                    self._input_done = True
                    self._tracker.input_done()
                break
            self._accept(batch)
        return [self._ready.popleft() for _ in range(min(max_rows, len(self._ready)))]

    def __iter__(self) -> Iterator[FeedItem]:
        while not self.exhausted:
            yield from self.take(self._batch_rows, wait=True)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the reader (waiting up to ``timeout`` seconds for it)."""
        self._ahead.close(timeout)

    def _accept(self, batch: _FeedBatch) -> None:
        self.rows_read += batch.rows_read
        self.rows_resumed += batch.rows_resumed
        for item in batch.items:
            self._tracker.row_seen(_row_index(item))
            if isinstance(item, InputRow) and item.error is not None:
                self._tracker.add_result(error_result(item, item.error, self._model))
                self._progress.update(1, 0)
            else:
                self._ready.append(item)


def _read(
    cfg: InputConfig,
    committed: frozenset[int],
    rows_per_shard: int,
    prepare: Prepare | None,
    batch_rows: int,
    schema: OutputSchema | None,
) -> Iterator[_FeedBatch]:
    """The reader thread's work: the input in batches, committed shards skipped, good rows
    prepared. The last batch carries the counts of the rows after the last item."""
    rows: list[InputRow] = []
    read = resumed = 0
    for row in iter_input_rows(cfg, schema):
        read += 1
        if row.row_index // rows_per_shard in committed:
            resumed += 1
            continue
        rows.append(row)
        if len(rows) == batch_rows:
            yield _FeedBatch(_prepared(rows, prepare), read, resumed)
            rows, read, resumed = [], 0, 0
    yield _FeedBatch(_prepared(rows, prepare), read, resumed)


def _prepared(rows: list[InputRow], prepare: Prepare | None) -> list[FeedItem]:
    """``rows`` with each good row replaced by what ``prepare`` makes of it; bad rows kept."""
    good = [r for r in rows if r.error is None]
    if prepare is None or not good:
        return list(rows)
    ready: Iterator[ReadyRow | ResultRow] = iter(prepare(good))
    return [row if row.error is not None else next(ready) for row in rows]
