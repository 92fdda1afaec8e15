"""Manifest.load reads the journal's records concurrently (one GET each costs 10-50 ms on an
object store: 1,000 records one after another were seconds to tens of seconds at every
start, resume, status or dry run) and gives the manifest a read one record at a time gives:
journal records over the file's, in shard order, a record deleted since the listing skipped,
a malformed one a ManifestError naming it, a store error raised, other names left alone."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest

from tests.fault_proxy import FaultyS3, faulty_s3  # noqa: F401
from tests.s3_server import s3_endpoint  # noqa: F401
from tokenmill.io.storage import OutputStore
from tokenmill.jobs.manifest import Manifest, ManifestError, ShardRecord

JOB = "t"
FILE_SHARDS = 40  # in the manifest file: 0..39
JOURNAL = range(30, 130)  # in the journal: 30..39 supersede the file's records


def _record(index: int, ok: int) -> ShardRecord:
    return ShardRecord(index * 10, index * 10 + 10, ok, 10 - ok, f"shards/{index}.jsonl", None)


def _output(store: OutputStore) -> None:
    """The manifest file's records (ok 10), journal records (ok 9), and other names."""
    manifest = Manifest(JOB, "fp", 10, {i: _record(i, 10) for i in range(FILE_SHARDS)})
    manifest.save(store)
    for index in JOURNAL:
        store.write_atomic(
            manifest._journal_entry(index), json.dumps(vars(_record(index, 9))).encode()
        )
    prefix = Manifest.journal_prefix(JOB)
    store.write_atomic(f"{prefix}00000003.json.bak", b"not a record")
    store.write_atomic(f"{prefix}notes.txt", b"not a record")


def _sequential(store: OutputStore, monkeypatch: pytest.MonkeyPatch) -> Manifest | None:
    """Manifest.load reading one record after another, as it did."""
    with monkeypatch.context() as patch:
        patch.setattr(store, "read_many", lambda names: [store.read_bytes(n) for n in names])
        return Manifest.load(store, JOB)


def _same(a: Manifest | None, b: Manifest | None) -> None:
    assert a is not None and b is not None
    assert a == b  # the dataclass's fields: shards, complete, settings, …
    assert (a.journaled, a.superseded) == (b.journaled, b.superseded)
    assert list(a.shards) == list(b.shards)  # applied in one order


def _store(kind: str, tmp_path: Path, s3: tuple[str, dict[str, Any]] | None) -> OutputStore:
    if kind == "local":
        return OutputStore(str(tmp_path / "out"), owner=JOB)
    assert s3 is not None
    bucket = f"tm-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", **s3[1]).mkdir(bucket)
    return OutputStore(f"s3://{bucket}/out", s3[1], owner=JOB)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> OutputStore:
    s3 = request.getfixturevalue("s3_endpoint") if request.param == "s3" else None
    return _store(request.param, tmp_path, s3)


def test_a_concurrent_load_is_the_sequential_one(
    store: OutputStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _output(store)
    loaded = Manifest.load(store, JOB)
    _same(loaded, _sequential(store, monkeypatch))
    assert loaded is not None
    assert sorted(loaded.shards) == list(range(130))
    assert loaded.journaled == set(JOURNAL)
    assert sorted(loaded.superseded) == list(range(30, 40))
    assert all(loaded.shards[i].ok == (9 if i in JOURNAL else 10) for i in loaded.shards)


def test_a_record_deleted_after_the_listing_is_skipped(
    store: OutputStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compaction between the listing and the reads: the manifest file holds them now."""
    _output(store)
    gone = [Manifest(JOB, "fp", 10)._journal_entry(i) for i in (35, 77)]
    listing = store.list

    def list_then_compact(prefix: str = "") -> list[str]:
        names = listing(prefix)
        store.delete_many(gone)
        return names

    monkeypatch.setattr(store, "list", list_then_compact)
    loaded = Manifest.load(store, JOB)
    _output(store)
    _same(loaded, _sequential(store, monkeypatch))
    assert loaded is not None
    assert 77 not in loaded.shards and loaded.shards[35] == _record(35, 10)
    assert loaded.journaled == set(JOURNAL) - {35, 77}


def test_names_in_folders_below_the_journal_are_not_records(store: OutputStore) -> None:
    """Only names directly in the journal's folder are records: a copy a person kept in
    ``<job>.manifest.d/old/`` had been read as shard 3's record."""
    _output(store)
    old = f"{Manifest.journal_prefix(JOB)}old/00000003.json"
    store.write_atomic(old, json.dumps(vars(_record(3, 1))).encode())
    loaded = Manifest.load(store, JOB)
    assert loaded is not None and loaded.shards[3] == _record(3, 10)
    assert 3 not in loaded.journaled


def test_a_malformed_record_is_named(store: OutputStore) -> None:
    _output(store)
    bad = Manifest(JOB, "fp", 10)._journal_entry(100)
    store.write_atomic(bad, b'{"first_row": 0')
    with pytest.raises(ManifestError, match=f"{store.path(bad)} is not a tokenmill manifest"):
        Manifest.load(store, JOB)


def test_records_are_read_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Locally through a pool of threads: several reads are in flight together."""
    store = _store("local", tmp_path, None)
    _output(store)
    in_flight, most, lock = [0], [0], threading.Lock()
    read = store.read_bytes

    def slow_read(name: str) -> bytes | None:
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.005)  # a store's round trip
        with lock:
            in_flight[0] -= 1
        return read(name)

    monkeypatch.setattr(store, "read_bytes", slow_read)
    assert Manifest.load(store, JOB) is not None
    assert most[0] > 1


def test_records_are_read_at_once_on_s3(
    s3_endpoint: tuple[str, dict[str, Any]],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On S3 in one call of s3fs's: its GETs overlap."""
    import s3fs.core

    store = _store("s3", tmp_path, s3_endpoint)
    _output(store)
    in_flight, most = [0], [0]
    cat = s3fs.core.S3FileSystem._cat_file

    async def slow_cat(self: Any, path: str, *args: Any, **kwargs: Any) -> bytes:
        in_flight[0] += 1  # (one event loop: no lock)
        most[0] = max(most[0], in_flight[0])
        try:
            await asyncio.sleep(0.005)
            return await cat(self, path, *args, **kwargs)
        finally:
            in_flight[0] -= 1

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_cat_file", slow_cat)
    assert Manifest.load(store, JOB) is not None
    assert most[0] > 1


def test_a_store_error_is_raised_not_a_missing_record(faulty_s3: FaultyS3) -> None:  # noqa: F811
    fsspec.filesystem("s3", **faulty_s3.direct).mkdir("load-faults")
    store = OutputStore(
        "s3://load-faults/out", faulty_s3.options(timeout_s=10, retries=0), owner=JOB
    )
    _output(store)
    faulty_s3.proxy.fail(503, "SlowDown", methods=("GET",), path_contains="00000077.json")
    with pytest.raises(OSError) as raised:
        Manifest.load(store, JOB)
    assert not isinstance(raised.value, FileNotFoundError), raised.value
    assert "s3://load-faults/out" in str(raised.value)
    faulty_s3.proxy.clear()
    loaded = Manifest.load(store, JOB)
    assert loaded is not None and loaded.shards[77] == _record(77, 9)


def test_one_restored_shard_is_logged_in_the_singular(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A shard whose journal record names files that are gone while the manifest file's
    record matches: the record is restored, and the line said "1 shards keep"."""
    from tokenmill.jobs.report import JobReport
    from tokenmill.jobs.runner import _verify_committed

    store = _store("local", tmp_path, None)
    store.write_atomic("shards/0.jsonl", b"12345")
    kept = ShardRecord(0, 10, 10, 0, "shards/0.jsonl", None, data_bytes=5)
    gone = ShardRecord(0, 10, 10, 0, "shards/0-new.jsonl", None, data_bytes=5)
    manifest = Manifest(JOB, "fp", 10, {0: gone}, superseded={0: kept})
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        _verify_committed(store, manifest, JobReport(job=JOB, output="out/"))
    assert manifest.shards == {0: kept}
    assert "1 shard keeps the manifest's record (the files match it;" in caplog.text
