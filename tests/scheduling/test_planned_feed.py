"""The planner inside the job's RowFeed, with a stand-in engine (results made at once): length
order within the window, duplicates held and copied, and every row's result in its own
shard exactly once, across a stop and a resume, with memory bounded."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.io.readers import IdOnlyRow, InputConfig, RowPredicate
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs import peekable_input
from tokenmill.jobs.pipeline_bounds import PipelineBounds
from tokenmill.jobs.progress import Progress
from tokenmill.jobs.ready_rows import ReadyRow
from tokenmill.jobs.row_feed import FeedPlan, RowFeed
from tokenmill.jobs.shard_tracker import ShardTracker
from tokenmill.scheduling.planner_settings import PlannerSettings

CFG = InputConfig(path="unused.jsonl")
BOUNDS = PipelineBounds(batch_rows=8, read_ahead_rows=32, queued_shards=1)
WHOLE = PipelineBounds(batch_rows=8, read_ahead_rows=400, queued_shards=1)  # 300 rows fit


@dataclass(frozen=True)
class _Spec:
    """One input row: its prompt (a number standing for its token ids) and sampling."""

    prompt: int
    max_tokens: int = 8
    temperature: float = 0.0
    seed: int | None = None


class _Input:
    """A stand-in for iter_input_rows and the row preparer over ``specs``."""

    def __init__(self, specs: list[_Spec]) -> None:
        self.specs = specs
        self.all_read = threading.Event()

    def rows(
        self, cfg: InputConfig, schema: object = None, *, id_only: RowPredicate | None = None
    ) -> Iterator[InputRow | IdOnlyRow]:
        for i, spec in enumerate(self.specs):
            if id_only is not None and id_only(i):
                yield IdOnlyRow(i)  # (a committed shard's row: read for its id alone)
                continue
            yield InputRow(i, f"r{i}", f"in.jsonl:{i + 1}", prompt=f"p{spec.prompt}")
        self.all_read.set()

    def prepare(self, rows: list[InputRow]) -> list[ReadyRow | ResultRow]:
        out: list[ReadyRow | ResultRow] = []
        for row in rows:
            s = self.specs[row.row_index]
            params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, seed=s.seed)
            out.append(ReadyRow(row, [7, s.prompt, s.prompt % 5], params))
        return out


def _engine_result(item: ReadyRow) -> ResultRow:
    """What a deterministic engine gives: the text follows from the prompt and sampling."""
    p = item.params
    text = f"out({item.prompt_ids[1]},{p.max_tokens},{p.temperature},{p.seed})"
    return ResultRow(
        item.row.row_index, item.row.row_id, text=text, finish_reason="length",
        prompt_tokens=3, completion_tokens=p.max_tokens, source=item.row.source,
    )  # fmt: skip


def _feed(
    monkeypatch: pytest.MonkeyPatch,
    source: _Input,
    settings: PlannerSettings | None,
    committed: frozenset[int] = frozenset(),
    rows_per_shard: int = 10,
) -> tuple[RowFeed, ShardTracker]:
    """A feed over ``source``; the whole input read ahead before it returns, so the window
    holds what it may at the first ``take`` whatever the threads' timing."""
    monkeypatch.setattr(peekable_input, "iter_input_rows", source.rows)
    tracker = ShardTracker(rows_per_shard)
    progress = Progress(None, 0, enabled=False)
    plan = None if settings is None else FeedPlan(settings, {}, prefill_tokens_per_step=64)
    feed = RowFeed(CFG, committed, tracker, progress, "m", source.prepare, WHOLE, plan=plan)
    assert source.all_read.wait(10)
    return feed, tracker


def _run(
    feed: RowFeed, tracker: ShardTracker, stop_after: int | None = None
) -> tuple[list[int], dict[int, list[ResultRow]]]:
    """Take rows 5 at a time and answer each at once (a stand-in engine), committing
    complete shards as the runner does; stop after ``stop_after`` rows ran. Returns the
    row indices in the order they ran and the committed shards."""
    ran: list[int] = []
    committed: dict[int, list[ResultRow]] = {}
    try:
        while not feed.exhausted:
            for item in feed.take(5, wait=True):
                assert isinstance(item, ReadyRow)
                ran.append(item.row.row_index)
                result = _engine_result(item)
                tracker.add_result(result)
                feed.finished(result)
                committed.update(tracker.pop_complete())
                if stop_after is not None and len(ran) >= stop_after:
                    return ran, committed
        committed.update(tracker.pop_complete())
    finally:
        feed.close()
    return ran, committed


def _texts(shards: dict[int, list[ResultRow]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for results in shards.values():
        for r in results:
            assert r.row_id not in out, f"{r.row_id} written twice"
            out[r.row_id] = r.text
    return out


def _mixed(n: int, seed: int = 0, dup_share: float = 0.0) -> list[_Spec]:
    """Rows of widely varying max_tokens; ``dup_share`` of them repeat one of the 8 rows
    before them."""
    rng = random.Random(seed)
    specs: list[_Spec] = []
    for i in range(n):
        if specs and rng.random() < dup_share:
            specs.append(rng.choice(specs[-8:]))
        else:
            specs.append(_Spec(prompt=1000 + i, max_tokens=rng.choice([4, 8, 16, 256])))
    return specs


def test_length_order_runs_long_rows_first_and_changes_no_result(monkeypatch) -> None:
    specs = _mixed(300)
    ran_input, shards_input = _run(*_feed(monkeypatch, _Input(specs), None))
    assert ran_input == list(range(300))
    window = 40
    ran, shards = _run(*_feed(monkeypatch, _Input(specs), PlannerSettings("length", window, False)))
    assert sorted(ran) == list(range(300)) and ran != ran_input
    assert max(pos - i for pos, i in enumerate(ran)) <= window  # none held past the window
    first = [specs[i].max_tokens for i in ran[:20]]
    long_in_window = [s.max_tokens for s in specs[:window]].count(256)
    assert first.count(256) >= min(20, long_in_window) >= 8  # the window's long rows first
    assert _texts(shards) == _texts(shards_input)  # every row once, in its own shard
    assert {k: [r.row_index for r in v] for k, v in shards.items()} == {
        k: [r.row_index for r in v] for k, v in shards_input.items()
    }


def test_duplicates_run_once_and_every_row_gets_its_own_result(monkeypatch) -> None:
    specs = _mixed(200, seed=1, dup_share=0.3)
    unique = len(set(specs))
    _, shards_off = _run(*_feed(monkeypatch, _Input(specs), PlannerSettings("input", 32, False)))
    feed, tracker = _feed(monkeypatch, _Input(specs), PlannerSettings("length", 32, True))
    ran, shards = _run(feed, tracker)
    assert len(ran) == unique and feed.rows_deduplicated == 200 - unique
    assert _texts(shards) == _texts(shards_off)
    copies = {r.row_id: r for results in shards.values() for r in results}
    for i in range(len(specs)):  # a copy carries its own row's identity
        assert copies[f"r{i}"].row_index == i and copies[f"r{i}"].source == f"in.jsonl:{i + 1}"
    saved = sum(specs[i].max_tokens + 3 for i in range(200)) - sum(
        specs[i].max_tokens + 3 for i in ran
    )
    assert feed.deduplicated_tokens == saved


def test_rows_sampled_without_a_seed_are_never_deduplicated(monkeypatch) -> None:
    specs = [_Spec(prompt=1, temperature=0.8)] * 5 + [_Spec(prompt=2, temperature=0.8, seed=3)] * 5
    feed, tracker = _feed(monkeypatch, _Input(specs), PlannerSettings())
    ran, shards = _run(feed, tracker)
    assert sorted(ran) == [0, 1, 2, 3, 4, 5]  # the unseeded five all run; seeded ones once
    assert feed.rows_deduplicated == 4 and len(_texts(shards)) == 10


def test_a_stop_and_a_resume_write_every_row_exactly_once(monkeypatch) -> None:
    """Stop with rows queued in the window, held for twins and unfinished; the resume skips
    the committed shards and recomputes the rest: each row once, as an uninterrupted run."""
    specs = _mixed(200, seed=2, dup_share=0.3)
    settings = PlannerSettings("length", 24, True)
    _, whole = _run(*_feed(monkeypatch, _Input(specs), PlannerSettings("input", 1, False)))
    _, first = _run(*_feed(monkeypatch, _Input(specs), settings), stop_after=70)
    assert 0 < len(first) < 20
    _, second = _run(*_feed(monkeypatch, _Input(specs), settings, committed=frozenset(first)))
    assert not set(first) & set(second)
    assert _texts(first | second) == _texts(whole)


def test_unprepared_rows_are_ordered_and_deduplicated_by_their_text(monkeypatch) -> None:
    """The Ray executor's feed hands out rows as read (its replicas tokenize): work and
    dedup keys come from the text and the row's own sampling fields."""
    spelled = [("a", 4), ("b", 4), ("c", 300), ("a", 4), ("d", None), ("c", 300), ("e", 300)]
    spelled += [("b", None), ("b", 5)]  # None: the job's max_tokens (4), as row 1's
    rows = [
        InputRow(i, f"r{i}", f"in:{i}", prompt=p, sampling={} if m is None else {"max_tokens": m})
        for i, (p, m) in enumerate(spelled)
    ]
    monkeypatch.setattr(peekable_input, "iter_input_rows", lambda cfg, schema=None: iter(rows))
    tracker = ShardTracker(100)
    plan = FeedPlan(PlannerSettings(), {"max_tokens": 4, "temperature": 0.0}, 8192)
    progress = Progress(None, 0, enabled=False)
    one_batch = PipelineBounds(batch_rows=16, read_ahead_rows=32, queued_shards=1)
    feed = RowFeed(CFG, frozenset(), tracker, progress, "m", None, one_batch, plan=plan)
    try:
        taken = list(feed)
    finally:
        feed.close()
    indices = [row.row_index for row in taken]
    assert all(isinstance(row, InputRow) for row in taken)
    assert indices[:2] == [2, 6]  # the long rows first
    assert sorted(indices) == [0, 1, 2, 4, 6, 8]  # 3, 5 and 7 repeat 0, 2 and 1
    assert tracker.num_pending_rows == 9


def test_memory_stays_bounded_on_a_long_input(monkeypatch) -> None:
    """10,000 rows, a 64-row window, 30% duplicates: the rows read ahead of the engine and
    the results waiting in open shards stay within the window's bounds, also when the
    reader gets as far ahead as it may (the engine pausing now and then)."""
    specs = _mixed(10_000, seed=3, dup_share=0.3)
    settings = PlannerSettings("length", 64, True)
    source = _Input(specs)
    read = 0

    def counting(cfg: InputConfig, schema: object = None) -> Iterator[InputRow]:
        nonlocal read
        for row in source.rows(cfg, schema):
            read += 1
            yield row

    monkeypatch.setattr(peekable_input, "iter_input_rows", counting)
    tracker = ShardTracker(50)
    feed = RowFeed(
        CFG, frozenset(), tracker, Progress(None, 0, enabled=False), "m", source.prepare,
        BOUNDS, plan=FeedPlan(settings, {}, 64),
    )  # fmt: skip
    done = 0
    most_ahead = most_waiting = 0
    try:
        while not feed.exhausted:
            if done % 1000 < 16:  # let the reader fill its queue
                deadline = time.monotonic() + 10
                while not feed._ahead._queue.full() and read < len(specs):
                    assert time.monotonic() < deadline
                    time.sleep(0.002)
            for item in feed.take(16, wait=True):
                result = _engine_result(item)
                tracker.add_result(result)
                feed.finished(result)
            done += sum(len(results) for _, results in tracker.pop_complete())
            waiting = sum(len(p.results) for p in tracker._pending.values())
            most_waiting = max(most_waiting, waiting)
            most_ahead = max(most_ahead, read - done)
    finally:
        feed.close()
    done += sum(len(results) for _, results in tracker.pop_complete())
    assert done == 10_000
    # read ahead + batches in hand + the window + rows held for twins + two open shards
    limit = BOUNDS.read_ahead_rows + 2 * BOUNDS.batch_rows + 3 * 64 + 2 * 50
    assert most_ahead >= BOUNDS.read_ahead_rows + 64  # the reader and the window were full
    assert most_ahead <= limit, (most_ahead, limit)
    assert most_waiting <= limit
