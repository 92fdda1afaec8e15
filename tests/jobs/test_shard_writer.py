"""ShardWriter: shards committed on a writer thread, in order, recorded in the manifest; its
errors re-raised on the engine thread; a full queue holds the engine back (bounded); an
abandoned writer never makes the engine thread wait."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tokenmill.io.rows import ResultRow
from tokenmill.io.storage import OutputStore
from tokenmill.jobs import shard_writer
from tokenmill.jobs.manifest import Manifest, ShardRecord
from tokenmill.jobs.shard_commit import commit_shard
from tokenmill.jobs.shard_writer import ShardWriter

ROWS = 3


def _results(shard: int) -> list[ResultRow]:
    return [
        ResultRow(i, f"r{i}", text=f"text {i}", finish_reason="stop", completion_tokens=2)
        for i in range(shard * ROWS, (shard + 1) * ROWS)
    ]


def _writer(tmp_path: Path, max_queued: int = 2) -> tuple[ShardWriter, OutputStore, Manifest]:
    store = OutputStore(str(tmp_path / "out"), owner="t")
    manifest = Manifest("t", "fp", ROWS)
    manifest.save(store)  # as a run does before its first shard
    return ShardWriter(store, manifest, "jsonl", max_queued), store, manifest


def _saved_shards(store: OutputStore) -> list[int]:
    """The shards a rerun would find committed."""
    saved = Manifest.load(store, "t")
    return [] if saved is None else sorted(saved.shards)


def test_shards_are_committed_in_order_and_recorded(tmp_path: Path) -> None:
    writer, store, manifest = _writer(tmp_path)
    for shard in (0, 2, 1):
        writer.submit(shard, _results(shard))
    writer.finish()
    assert (writer.shards_committed, writer.rows_committed) == (3, 3 * ROWS)
    assert sorted(manifest.shards) == _saved_shards(store) == [0, 1, 2]
    for shard, record in manifest.shards.items():
        data = (tmp_path / "out" / record.data).read_bytes()
        assert data and record.data_bytes == len(data) and record.first_row == shard * ROWS


class _Gate:
    """commit_shard that waits for ``open`` (and counts calls), or raises ``error`` at call
    ``fail_at``."""

    def __init__(self, error: BaseException | None = None, fail_at: int = -1) -> None:
        self.open = threading.Event()
        self.started = 0
        self.error, self.fail_at = error, fail_at

    def __call__(self, *args: Any) -> Any:
        self.started += 1
        if self.started - 1 == self.fail_at:
            assert self.error is not None
            raise self.error
        self.open.wait(30)
        return commit_shard(*args)


def test_a_full_queue_blocks_the_engine_thread_within_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _Gate()
    monkeypatch.setattr(shard_writer, "commit_shard", gate)
    writer, _, _ = _writer(tmp_path, max_queued=2)
    submitted = []

    def engine() -> None:
        for shard in range(10):
            writer.submit(shard, _results(shard))
            submitted.append(shard)

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while len(submitted) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert gate.started == 1 and len(submitted) == 3  # one being written, two queued
    gate.open.set()
    thread.join(10)
    writer.finish()
    assert len(submitted) == 10 and writer.shards_committed == 10


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), RuntimeError("bug")])
def test_a_writer_error_is_raised_on_the_engine_thread_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    gate = _Gate(error, fail_at=1)
    gate.open.set()
    monkeypatch.setattr(shard_writer, "commit_shard", gate)
    writer, store, manifest = _writer(tmp_path, max_queued=1)
    with pytest.raises(type(error)) as raised:
        for shard in range(100):  # submit notices the failure: it does not hang
            writer.submit(shard, _results(shard))
    assert raised.value is error
    with pytest.raises(type(error)):
        writer.finish()
    assert sorted(manifest.shards) == _saved_shards(store) == [0]  # the one before it


def test_abandon_leaves_a_hung_write_behind_and_records_nothing_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = _Gate()
    monkeypatch.setattr(shard_writer, "commit_shard", gate)
    writer, store, manifest = _writer(tmp_path, max_queued=2)
    writer.submit(0, _results(0))
    writer.submit(1, _results(1))
    deadline = time.monotonic() + 10
    while gate.started == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    writer.abandon()
    assert time.monotonic() - start < 1 and writer.abandoned
    gate.open.set()  # the hung write completes later
    writer._thread.join(10)
    assert not writer._thread.is_alive()
    assert manifest.shards == {} and _saved_shards(store) == []  # a rerun recomputes it
    assert gate.started == 1  # the queued shard was dropped


def test_a_shard_whose_record_is_written_as_the_run_stops_is_counted_once_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second stop signal during a shard's (slow) journal write: the write lands after the
    stop. Counted at the stop, the run's report said one shard fewer than a rerun finds; the
    record was once put in the manifest before its write, and the report said rows_ok 8
    beside rows_this_run 4 (an audit). ``abandon`` does not wait for the write; ``settle``
    does, and then the manifest here, the counts and the store agree."""
    writer, store, manifest = _writer(tmp_path, max_queued=2)
    writer.submit(0, _results(0))
    writer.submit(1, _results(1))
    writer.finish()  # shards 0 and 1 committed
    started, release = threading.Event(), threading.Event()
    write = store.write_atomic

    def slow(name: str, data: bytes) -> None:
        if name.startswith("t.manifest"):
            started.set()
            release.wait(10)
        write(name, data)

    monkeypatch.setattr(store, "write_atomic", slow)
    writer = ShardWriter(store, manifest, "jsonl", 2)
    writer.submit(2, _results(2))
    writer.submit(3, _results(3))
    assert started.wait(10)
    stopped = time.monotonic()
    writer.abandon()
    assert time.monotonic() - stopped < 1  # a hung record write does not hold the stop
    assert not writer.settle(timeout=0.2)  # the record is still being written
    assert sorted(manifest.shards) == [0, 1]  # not counted before it is written
    release.set()
    assert writer.settle(timeout=10)
    assert sorted(manifest.shards) == _saved_shards(store) == [0, 1, 2]  # shard 3: dropped
    assert (writer.shards_committed, writer.rows_committed) == (1, ROWS)


def test_the_manifest_journal_is_folded_in_and_reloads_whole(tmp_path: Path, monkeypatch) -> None:
    """Each commit writes one small journal record; past the journal's bound the manifest
    file is rewritten with them and the records go. A load merges file and journal, also
    after a crash between the rewrite and the deletes (both then name the shard)."""
    from tokenmill.jobs import manifest as manifest_module

    monkeypatch.setattr(manifest_module, "_MIN_JOURNAL", 4)
    store = OutputStore(str(tmp_path / "out"), owner="t")
    manifest = Manifest("t", "fp", ROWS)
    manifest.save(store)
    writes: list[str] = []
    write = store.write_atomic
    monkeypatch.setattr(store, "write_atomic", lambda n, d: writes.append(n) or write(n, d))
    record = ShardRecord(0, ROWS, ROWS, 0, "shards/part-00000.jsonl", None)
    for shard in range(10):
        manifest.commit_shard(store, shard, record)
        assert sorted(Manifest.load(store, "t").shards) == list(range(shard + 1))
    rewrites = [n for n in writes if n == "t.manifest.json"]
    assert len(rewrites) == 2 and len(writes) == 10  # shards 4 and 9 folded the journal in
    assert store.list("t.manifest.d/") == []
    for shard in (10, 11):
        manifest.commit_shard(store, shard, record)
    assert store.list("t.manifest.d/") == [
        "t.manifest.d/00000010.json",
        "t.manifest.d/00000011.json",
    ]
    monkeypatch.setattr(store, "delete", lambda name: None)  # killed before the deletes
    manifest.save(store)
    again = Manifest.load(store, "t")
    assert sorted(again.shards) == list(range(12)) and again.journaled == {10, 11}


@pytest.mark.parametrize("compacting", [False, True])
def test_a_shard_whose_manifest_write_fails_is_not_committed_in_memory_either(
    tmp_path: Path, monkeypatch, compacting: bool
) -> None:
    """An audit: the record went into the manifest before its journal write (or rewrite),
    which then failed (an object store's 500s): a failed run's report counted the shard,
    rows_ok 12 of 16 rows with 8 committed."""
    from tokenmill.jobs import manifest as manifest_module

    monkeypatch.setattr(manifest_module, "_MIN_JOURNAL", 1 if compacting else 100)
    store = OutputStore(str(tmp_path / "out"), owner="t")
    manifest = Manifest("t", "fp", ROWS)
    manifest.save(store)
    old = ShardRecord(0, ROWS, ROWS, 0, "shards/part-00000.jsonl", None)
    manifest.commit_shard(store, 0, old)
    write = store.write_atomic

    def failing(name: str, data: bytes) -> None:
        raise OSError(f"writing {name} failed: 500")

    monkeypatch.setattr(store, "write_atomic", failing)
    new = ShardRecord(ROWS, 2 * ROWS, ROWS, 0, "shards/part-00001.jsonl", None)
    redone = ShardRecord(0, ROWS, 0, ROWS, None, "errors/part-00000.jsonl")
    for index, record in ((1, new), (0, redone)):
        with pytest.raises(OSError, match="500"):
            manifest.commit_shard(store, index, record)
    assert manifest.shards == {0: old} and manifest.rows_done == ROWS
    monkeypatch.setattr(store, "write_atomic", write)
    assert Manifest.load(store, "t").shards == {0: old}


def test_the_manifest_is_written_a_record_a_line(tmp_path: Path) -> None:
    """Written record by record with json's C encoder (indent= took its Python encoder and
    asdict copied every record deeply: 2.2 s a rewrite at 30,000 shards); it reads back as
    it was, and a shard's record is one line."""
    store = OutputStore(str(tmp_path / "out"), owner="t")
    manifest = Manifest("t", "fp", ROWS, settings={"model": {"a": [1, "b"]}})
    manifest.save(store)
    assert json.loads((tmp_path / "out" / "t.manifest.json").read_text())["shards"] == {}
    for shard in range(3):
        error = f"errors/part-0000{shard}.jsonl" if shard == 1 else None
        manifest.shards[shard] = ShardRecord(
            shard * ROWS, (shard + 1) * ROWS, ROWS, 0, f"shards/part-0000{shard}.jsonl", error
        )
    manifest.shards[3] = ShardRecord(3 * ROWS, 4 * ROWS, 0, ROWS, None, "errors/x.jsonl")
    manifest.complete, manifest.total_rows = True, 4 * ROWS
    manifest.save(store)
    text = (tmp_path / "out" / "t.manifest.json").read_text()
    raw = json.loads(text)
    assert raw["complete"] is True and raw["settings"] == {"model": {"a": [1, "b"]}}
    assert sum('"first_row"' in line for line in text.splitlines()) == 4
    again = Manifest.load(store, "t")
    assert again.shards == manifest.shards and again.total_rows == 4 * ROWS
