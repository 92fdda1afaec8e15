"""RowFeed: the input read and prepared ahead on a reader thread, within its bound in rows,
handed to the engine thread in input order with the shard tracker kept as a serial run does."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.io.readers import IdOnlyRow, InputConfig, RowPredicate
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs import peekable_input, row_feed
from tokenmill.jobs.pipeline_bounds import PipelineBounds
from tokenmill.jobs.progress import Progress
from tokenmill.jobs.ready_rows import ReadyRow
from tokenmill.jobs.row_feed import RowFeed
from tokenmill.jobs.shard_tracker import ShardTracker

CFG = InputConfig(path="unused.jsonl")


class _Input:
    """A stand-in for iter_input_rows: ``n`` rows, every ``bad_every``-th one bad; counts the
    rows read and the rows prepared."""

    def __init__(self, n: int, bad_every: int = 0, fail_at: int | None = None) -> None:
        self.n, self.bad_every, self.fail_at = n, bad_every, fail_at
        self.read = 0
        self.prepared = 0

    def rows(
        self, cfg: InputConfig, schema: object = None, *, id_only: RowPredicate | None = None
    ) -> Iterator[InputRow | IdOnlyRow]:
        for i in range(self.n):
            if i == self.fail_at:
                raise OSError(f"connection reset reading row {i}")
            self.read += 1
            if id_only is not None and id_only(i):
                yield IdOnlyRow(i)  # (read for its id alone, as iter_input_rows does)
                continue
            bad = self.bad_every and i % self.bad_every == 0
            yield InputRow(i, f"r{i}", f"in:{i}", prompt=f"p{i}", error="bad" if bad else None)

    def prepare(self, rows: list[InputRow]) -> list[ReadyRow | ResultRow]:
        self.prepared += len(rows)
        return [ReadyRow(r, [1, 2, 3], SamplingParams()) for r in rows]


def _wait_until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _feed(
    monkeypatch: pytest.MonkeyPatch,
    source: _Input,
    bounds: PipelineBounds,
    committed: frozenset[int] = frozenset(),
    rows_per_shard: int = 1000,
) -> tuple[RowFeed, ShardTracker, Progress]:
    monkeypatch.setattr(peekable_input, "iter_input_rows", source.rows)
    tracker = ShardTracker(rows_per_shard)
    progress = Progress(None, 0, enabled=False)
    feed = RowFeed(CFG, committed, tracker, progress, "m", source.prepare, bounds)
    return feed, tracker, progress


def test_a_100k_row_input_is_never_more_than_the_bound_ahead(monkeypatch) -> None:
    source = _Input(100_000)
    bounds = PipelineBounds(batch_rows=50, read_ahead_rows=500, queued_shards=1)
    feed, tracker, _ = _feed(monkeypatch, source, bounds)
    # in the queue, in the reader's hands while it waits for room, in the feed's buffer
    limit = bounds.read_ahead_rows + 2 * bounds.batch_rows
    taken = 0
    most_ahead = 0
    try:
        while not feed.exhausted:
            items = feed.take(7, wait=True)
            taken += len(items)
            most_ahead = max(most_ahead, source.read - taken)
            assert source.read - taken <= limit
            assert source.prepared <= source.read
            if taken % 20_000 < 7:  # let the reader run as far as it may, then check again
                _wait_until(lambda: feed._ahead._queue.full() or source.read == source.n)
                assert source.read - taken <= limit
    finally:
        feed.close()
    assert taken == 100_000 and feed.rows_read == 100_000
    assert most_ahead >= bounds.read_ahead_rows  # it did read ahead, up to the bound
    assert tracker.num_pending_rows == 100_000  # seen in order, awaiting results


def test_bad_rows_become_results_in_order_and_committed_shards_are_skipped(monkeypatch) -> None:
    source = _Input(40, bad_every=3)
    bounds = PipelineBounds(batch_rows=4, read_ahead_rows=8, queued_shards=1)
    feed, tracker, progress = _feed(
        monkeypatch, source, bounds, committed=frozenset({1}), rows_per_shard=10
    )
    good = list(feed)
    feed.close()
    indices = [item.row.row_index for item in good if isinstance(item, ReadyRow)]
    want = [i for i in range(40) if i % 3 and not 10 <= i < 20]
    assert indices == want
    assert feed.rows_read == 40  # the committed shard's 10 rows read and skipped
    assert progress.done == sum(1 for i in range(40) if i % 3 == 0 and not 10 <= i < 20)
    for item in good:  # results for every good row: then each shard is complete
        tracker.add_result(ResultRow(item.row.row_index, item.row.row_id))
    assert [k for k, _ in tracker.pop_complete()] == [0, 2, 3]


def test_a_reader_error_is_raised_by_take_after_the_rows_before_it(monkeypatch) -> None:
    source = _Input(1000, fail_at=130)
    bounds = PipelineBounds(batch_rows=16, read_ahead_rows=32, queued_shards=1)
    feed, _, _ = _feed(monkeypatch, source, bounds)
    taken = 0
    with pytest.raises(OSError, match="row 130"):
        while not feed.exhausted:
            taken += len(feed.take(10, wait=True))
    feed.close()
    assert taken == 128  # the full batches before the failing one


def test_a_stretch_of_bad_rows_is_handed_on_a_bounded_read_at_a_time(monkeypatch) -> None:
    """One take read a whole input of bad rows (1M held in memory, no shard committed, a
    SIGTERM unseen for the whole stretch): now it returns after TAKE_READ_ROWS, empty, and
    says that the tracker has results to commit."""
    monkeypatch.setattr(row_feed, "TAKE_READ_ROWS", 20)
    source = _Input(200, bad_every=1)  # every row bad
    bounds = PipelineBounds(batch_rows=5, read_ahead_rows=10, queued_shards=1)
    monkeypatch.setattr(peekable_input, "iter_input_rows", source.rows)
    tracker = ShardTracker(10)
    calls: list[int] = []
    feed = RowFeed(
        CFG, frozenset(), tracker, Progress(None, 0, enabled=False), "m", source.prepare, bounds,
        on_results=lambda: calls.append(len(tracker.pop_complete())),
    )  # fmt: skip
    takes = 0
    try:
        while not feed.exhausted:
            before = feed.rows_read
            assert feed.take(8, wait=True) == []
            assert feed.rows_read - before <= 20 + bounds.batch_rows
            takes += 1
    finally:
        feed.close()
    assert takes >= 200 // 25 and calls[0] >= 1  # shards go on while the input is read
    assert sum(calls) + len(tracker.pop_complete()) == 20  # the last when the input ended
