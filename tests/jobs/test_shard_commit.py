"""commit_shard streams a shard's data file into the store: the bytes the whole-shard encoding
gave, without holding them (or its lines) in memory beside the rows; remove_stray_files
removes a crash's leftovers in batched requests on an object store."""

from __future__ import annotations

import io
import secrets
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.s3_server import s3_endpoint  # noqa: F401
from tokenmill.io import writers
from tokenmill.io.openai_batch_output import result_line
from tokenmill.io.output_schema import OutputSchema, strict_json
from tokenmill.io.rows import ResultRow
from tokenmill.io.storage import OutputStore
from tokenmill.jobs.manifest import Manifest
from tokenmill.jobs.shard_commit import commit_shard, remove_stray_files

MIB = 1 << 20


def _rows(count: int, blob_bytes: int) -> list[ResultRow]:
    return [
        ResultRow(
            i,
            f"r{i}",
            f"text {i} \u2028 é",  # a line break JSON leaves raw: escaped in JSON Lines
            "stop",
            3,
            2,
            passthrough={"blob": secrets.token_hex(blob_bytes // 2), "n": i},  # incompressible
            endpoint="/v1/chat/completions",
            custom_id=f"r{i}",
        )
        for i in range(count)
    ]


def _whole_shard_bytes(rows: list[ResultRow], fmt: str, schema: OutputSchema) -> bytes:
    """The data file as the encoder before streaming made it: every line joined, or one
    table written whole."""
    if fmt == "parquet":
        sink = pa.BufferOutputStream()
        pq.write_table(writers._parquet_table(rows, schema), sink)
        return sink.getvalue().to_pybytes()
    to_record = writers._plain_record if fmt == "jsonl" else lambda r: result_line(r, 0)
    lines = [strict_json(to_record(r)).translate(writers._LINE_BREAKS) + "\n" for r in rows]
    return "".join(lines).encode("utf-8")


@pytest.mark.parametrize("count", [0, 1, 5])
@pytest.mark.parametrize("fmt", writers.OUTPUT_FORMATS)
def test_a_shard_file_is_the_bytes_the_whole_shard_encoding_gave(
    tmp_path, fmt: str, count: int
) -> None:
    store = OutputStore(str(tmp_path), owner="t")
    rows = _rows(count, 64)
    schema = OutputSchema.inferred([{"blob": "x", "n": 1}])
    record = commit_shard(store, 0, rows, fmt, rows_per_shard=8, schema=schema)
    if count == 0 and fmt != "parquet":
        assert record.data is None  # no empty JSON Lines file, as before
        return
    data = (tmp_path / record.data).read_bytes()
    assert data == _whole_shard_bytes(rows, fmt, schema) and record.data_bytes == len(data)


def test_a_parquet_shard_of_wide_rows_is_written_in_bounded_row_groups(
    tmp_path, monkeypatch
) -> None:
    store = OutputStore(str(tmp_path), owner="t")
    rows = _rows(5, MIB)
    schema = OutputSchema.inferred([{"blob": "x", "n": 1}])
    monkeypatch.setattr(writers, "ROW_GROUP_BYTES", 2 * MIB + MIB // 2)  # two wide rows
    record = commit_shard(store, 0, rows, "parquet", rows_per_shard=8, schema=schema)
    data = (tmp_path / record.data).read_bytes()
    groups = pq.ParquetFile(io.BytesIO(data)).metadata
    assert [groups.row_group(g).num_rows for g in range(groups.num_row_groups)] == [2, 2, 1]
    assert pq.read_table(io.BytesIO(data)) == pq.read_table(
        io.BytesIO(_whole_shard_bytes(rows, "parquet", schema))
    )


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_shard_of_wide_rows_is_never_encoded_in_memory_whole(
    tmp_path, monkeypatch, fmt: str
) -> None:
    """400 rows of 5 MB in one JSON Lines shard peaked at 12 GB of RSS for 2 GB of input:
    committing held each line, their join and its bytes beside the rows (Parquet: the
    encoded file and its bytes). Python's allocations while committing now stay below
    half of the rows: a few lines, or a row group's pages, at a time (Arrow's own buffers
    are not traced)."""
    monkeypatch.setattr(writers, "ROW_GROUP_BYTES", 4 * MIB, raising=False)
    store = OutputStore(str(tmp_path), owner="t")
    rows = _rows(16, MIB)
    schema = OutputSchema.inferred([{"blob": "x", "n": 1}])
    tracemalloc.start()
    try:
        record = commit_shard(store, 0, rows, fmt, rows_per_shard=16, schema=schema)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert record.ok == 16 and record.data_bytes > 15 * MIB
    assert peak < 8 * MIB, f"{peak / MIB:.1f} MiB allocated while committing 16 MiB of rows"


def test_an_unwritable_row_is_a_row_error_and_the_rest_are_streamed(tmp_path) -> None:
    """The first write fails part-way (a lone surrogate); nothing of it is committed, and
    the other rows are written again."""
    store = OutputStore(str(tmp_path), owner="t")
    rows = _rows(3, 64)
    rows[1] = ResultRow(1, "r1", "bad \ud800", "stop", 3, 2)
    record = commit_shard(store, 0, rows, "jsonl", rows_per_shard=8)
    assert (record.ok, record.errors) == (2, 1)
    data = (tmp_path / record.data).read_bytes()
    assert data == _whole_shard_bytes([rows[0], rows[2]], "jsonl", OutputSchema.of([]))
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["part-00000.jsonl"]


def test_leftover_shard_files_on_s3_go_in_batched_deletes(s3_endpoint, monkeypatch) -> None:  # noqa: F811
    """A resume removes the shard files no committed shard names before its first row: one
    DELETE a file took 3.5 s for 500 of them on a local S3 (an audit); a batched delete
    (1,000 keys a request) takes one request, and the committed shard's file stays."""
    import s3fs.core

    _, options = s3_endpoint
    store = OutputStore("s3://jobs/out", options, owner="test")
    store.fs.mkdir("jobs")
    manifest = Manifest("test", "fp", rows_per_shard=3)
    manifest.add_record(0, commit_shard(store, 0, _rows(3, 8), "jsonl", 3), compacted=False)
    for shard in range(1, 41):
        store.write_atomic(f"shards/part-{shard:05d}.jsonl", b'{"id": "x"}\n')
    calls: list[str] = []
    call_s3 = s3fs.core.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        calls.append(method if isinstance(method, str) else method.__name__)
        return await call_s3(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", counting)
    assert remove_stray_files(store, manifest, store.sizes("shards/")) == 40
    deletes = [c for c in calls if c.startswith("delete_object")]
    assert deletes == ["delete_objects"], deletes
    assert store.list("shards/") == ["shards/part-00000.jsonl"]


def test_leftover_shard_files_the_store_refuses_to_delete_are_named(s3_endpoint) -> None:  # noqa: F811
    """S3's batched delete answers per key and s3fs drops the refusals: an error file left
    beside its recomputed shard would show its rows as failed as well as done. The files
    still there after the delete are named."""
    from tokenmill.io.storage import StorageError

    _, options = s3_endpoint
    store = OutputStore("s3://refusing-leftovers/out", options, owner="test")
    store.fs.mkdir("refusing-leftovers")
    names = ["shards/part-00001.jsonl", "errors/part-00001.jsonl", "errors/part-00002.jsonl"]
    for name in names:
        store.write_atomic(name, b'{"id": "x"}\n')
    rm = store.fs.rm
    store.fs.rm = lambda paths, *a, **k: rm(  # the store refuses the error files' keys
        [p for p in paths if "errors/" not in p] if isinstance(paths, list) else paths, *a, **k
    )
    manifest = Manifest("test", "fp", rows_per_shard=3)
    with pytest.raises(StorageError, match=r"could not delete 2 shard files.*part-00001"):
        remove_stray_files(store, manifest, names)
    assert store.list("shards/") == []
