"""Wide rows (a 5 MB passthrough column each): the rows read ahead of the engine are bounded
in bytes as well as in rows, so a job's memory does not grow to its whole input; a row larger
than every byte bound still runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs.job_helpers import job_dict
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.io.readers import InputConfig
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs import peekable_input
from tokenmill.jobs.local_executor import RowProcessor
from tokenmill.jobs.pipeline_bounds import PipelineBounds
from tokenmill.jobs.planned_rows import FeedPlan, PlannedRows, RowFacts
from tokenmill.jobs.progress import Progress
from tokenmill.jobs.ready_rows import ReadyRow
from tokenmill.jobs.row_bytes import input_row_bytes
from tokenmill.jobs.row_feed import RowFeed
from tokenmill.jobs.row_source import FeedItem, RowList
from tokenmill.jobs.shard_tracker import ShardTracker
from tokenmill.jobs.spec import coerce_spec
from tokenmill.scheduling.planner_settings import PlannerSettings

CFG = InputConfig(path="unused.jsonl")
MIB = 1 << 20
# One 2 MB string shared by every row: the rows weigh 2 MB each to the feed's estimate, and
# nothing to the test's memory.
WIDE = "x" * (2 * MIB)


class _WideInput:
    """A stand-in for iter_input_rows: ``n`` rows with a ``WIDE`` passthrough value each;
    counts the rows read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.read = 0

    def rows(self, cfg: InputConfig, schema: object = None) -> Iterator[InputRow]:
        for i in range(self.n):
            self.read += 1
            yield InputRow(i, f"r{i}", f"in:{i}", prompt=f"p{i}", passthrough={"big": WIDE})

    def prepare(self, rows: list[InputRow]) -> list[ReadyRow | ResultRow]:
        return [
            ReadyRow(r, [1, 2, 3], SamplingParams(max_tokens=i % 7 + 1)) for i, r in enumerate(rows)
        ]


def _settled(source: _WideInput) -> None:
    """Wait until the reader has read as far as it may (no new row for 0.2 s)."""
    last, since = source.read, time.monotonic()
    while time.monotonic() - since < 0.2:
        time.sleep(0.02)
        if source.read != last:
            last, since = source.read, time.monotonic()


def _feed(
    monkeypatch: pytest.MonkeyPatch,
    source: _WideInput,
    bounds: PipelineBounds,
    plan: FeedPlan | None,
) -> RowFeed:
    monkeypatch.setattr(peekable_input, "iter_input_rows", source.rows)
    tracker = ShardTracker(10)
    progress = Progress(None, 0, enabled=False)
    return RowFeed(CFG, frozenset(), tracker, progress, "m", source.prepare, bounds, plan=plan)


# How long _take_rows takes again before failing. A take with ``wait`` blocks 0.1 s at most
# (RowFeed's _WAIT_S, for its caller to see a cancel) and returns nothing when no batch came:
# a reader thread not scheduled that long (a loaded 2-core CI box) is no bug. A take that
# stops reading returns nothing at once, every time, and only it gets here: a reader needs
# microseconds a row, so 10 s is far past any scheduling delay while a failure stays short.
_NO_ROWS_S = 10.0


def _take_rows(feed: RowFeed, n: int) -> list[FeedItem]:
    """``feed.take(n, wait=True)`` until it gives rows, as the executor's loop takes. Taken
    once, the twins' test failed now and then under load (a first take that returned
    nothing in time: ``(first,) = []``)."""
    deadline = time.monotonic() + _NO_ROWS_S
    while not (items := feed.take(n, wait=True)):
        assert not feed.exhausted, "the input ended before another row was handed out"
        assert time.monotonic() < deadline, (
            f"take returned no row for {_NO_ROWS_S:g} s while the input had rows left"
        )
    return items


@pytest.mark.parametrize(
    "plan",
    [None, FeedPlan(PlannerSettings("length", 2048, dedup=False))],
    ids=["input-order", "length-window-2048"],
)
def test_wide_rows_read_ahead_stay_within_the_byte_budget(monkeypatch, plan) -> None:
    """Held before: 256-512 rows in the read-ahead queue, a batch of 64 in the reader's
    hands and up to 2,048 in the planner's window, 5.6 GB on a 2 GB input (an audit). Now:
    about read_ahead_bytes + window_bytes (256 MiB) and two batches of 16 MiB."""
    source = _WideInput(600)
    feed = _feed(monkeypatch, source, PipelineBounds.for_engine(8), plan)
    row_bytes = len(WIDE)
    limit = 256 * MIB + 2 * 16 * MIB + 2 * row_bytes  # the budget, two batches, a row each
    taken = []
    most_held = 0
    try:
        while not feed.exhausted:
            _settled(source)  # the reader as far ahead as it may get
            most_held = max(most_held, (source.read - len(taken)) * row_bytes)
            assert (source.read - len(taken)) * row_bytes <= limit
            taken += [item.row.row_index for item in feed.take(16, wait=True)]
    finally:
        feed.close()
    assert sorted(taken) == list(range(600))  # every row, once
    assert most_held >= 64 * MIB  # it did read ahead: 4 queued batches of 16 MiB at least


def test_a_row_larger_than_every_byte_bound_still_runs(monkeypatch) -> None:
    source = _WideInput(30)
    bounds = PipelineBounds(
        batch_rows=4, read_ahead_rows=8, batch_bytes=1, read_ahead_bytes=1, window_bytes=1
    )
    feed = _feed(monkeypatch, source, bounds, None)
    try:
        got = [item.row.row_index for item in feed]
    finally:
        feed.close()
    assert got == list(range(30))
    assert source.read - len(got) == 0


def test_results_kept_for_later_twins_keep_no_passthrough_values() -> None:
    """The dedup cache kept up to ``window`` (2,048) whole results, 5 MB passthrough values
    included (10 GB); a copy takes its own row's values, so the cache keeps none."""
    plan = FeedPlan(PlannerSettings("input", 2048, dedup=True))
    planned, facts = PlannedRows(plan), RowFacts(plan)
    rows = [
        ReadyRow(
            InputRow(i, f"r{i}", f"in:{i}", prompt="same", passthrough={"big": f"{i}" * 99}),
            [1],
            SamplingParams(max_tokens=1, temperature=0.0),
        )
        for i in range(2)
    ]
    assert planned.add(rows[0], facts(rows[0]), 200) is None
    assert planned.nbytes == 200
    (first,) = planned.take(1)
    assert planned.nbytes == 0
    planned.finished(ResultRow(0, "r0", text="done", passthrough=first.row.passthrough))
    cached = [result for result in planned._dedup._cache.values()]
    assert [r.passthrough for r in cached] == [{}]
    copy = planned.add(rows[1], facts(rows[1]), 200)  # its twin's result, its own values
    assert copy is not None and copy.text == "done" and copy.passthrough == {"big": "1" * 99}
    assert planned.nbytes == 0


class _TwinsFirst(_WideInput):
    """``twins`` rows with one prompt and greedy settings (duplicates of the first), then
    rows of their own."""

    def __init__(self, n: int, twins: int) -> None:
        super().__init__(n)
        self.twins = twins

    def rows(self, cfg: InputConfig, schema: object = None) -> Iterator[InputRow]:
        for i in range(self.n):
            self.read += 1
            prompt = "same" if i < self.twins else f"p{i}"
            yield InputRow(i, f"r{i}", f"in:{i}", prompt=prompt, passthrough={"big": WIDE})

    def prepare(self, rows: list[InputRow]) -> list[ReadyRow | ResultRow]:
        tokens = {"same": [7, 7]}
        greedy = SamplingParams(max_tokens=4, temperature=0.0)
        return [ReadyRow(r, tokens.get(r.prompt, [1, r.row_index]), greedy) for r in rows]


def test_rows_held_for_a_running_twin_do_not_stop_the_next_take(monkeypatch) -> None:
    """Rows held for a twin that runs weigh on the byte budget, but none of them can be
    handed out: a take that stopped reading on their weight alone returned nothing while
    the input still had rows to run (a caller that waits on the engine could then wait on
    rows that never come). It reads on until a row is queued."""
    source = _TwinsFirst(12, twins=4)
    bounds = PipelineBounds(
        batch_rows=4, read_ahead_rows=8, batch_bytes=MIB, read_ahead_bytes=MIB, window_bytes=MIB
    )
    feed = _feed(monkeypatch, source, bounds, FeedPlan(PlannerSettings("input", 64, dedup=True)))
    try:
        (first,) = _take_rows(feed, 1)  # row 0 runs; rows 1-3 are held for it
        assert first.row.row_index == 0
        nxt = _take_rows(feed, 1)
        assert [item.row.row_index for item in nxt] == [4]
    finally:
        feed.close()


class _OneAtATime:
    """A RowList handing out one row a take, noting the rows in flight at each take."""

    def __init__(self, rows: RowList, processor: RowProcessor) -> None:
        self._rows = rows
        self._processor = processor
        self.most_in_flight = 0

    @property
    def exhausted(self) -> bool:
        return self._rows.exhausted

    def take(self, max_rows: int, wait: bool) -> list[FeedItem]:
        items = self._rows.take(1, wait)
        held = len(self._processor._in_flight) + len(items)
        self.most_in_flight = max(self.most_in_flight, held)
        return items


@pytest.mark.parametrize(("bound_rows", "most"), [(2.5, 3), (0.1, 1)], ids=["bytes", "one-row"])
def test_rows_in_the_engine_stay_within_engine_bytes_but_one_always_runs(
    tiny_model: Path, tmp_path: Path, bound_rows: float, most: int
) -> None:
    """A row keeps its passthrough values in the engine: 2 x max_num_seqs rows in flight
    (16 here, 512 by default) of 5 MB each were 2.5 GB. No row is added while those in
    flight hold ``engine_bytes``, and a row larger than that alone still runs."""
    spec = coerce_spec(job_dict(tiny_model, tmp_path / "in.jsonl", tmp_path / "out"))
    processor = RowProcessor(spec)
    rows = [
        InputRow(
            i,
            f"r{i}",
            f"in:{i}",
            messages=[{"role": "user", "content": f"hi {i}"}],
            passthrough={"topic": WIDE},
        )  # fmt: skip
        for i in range(12)
    ]
    processor.max_in_flight_bytes = int(bound_rows * input_row_bytes(rows[0]))
    source = _OneAtATime(RowList(rows, processor.prepare), processor)
    try:
        results = list(processor.process(source))
    finally:
        processor.close()
    assert sorted(r.row_index for r in results) == list(range(12))
    assert all(r.error is None and r.passthrough == {"topic": WIDE} for r in results)
    assert source.most_in_flight == most  # (8 without the bound: its first rows finish)
    assert processor._in_flight.nbytes == 0
