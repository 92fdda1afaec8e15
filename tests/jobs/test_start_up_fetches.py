"""What a job's start-up checks download from an object store (moto's S3): about what they
read, not a whole s3fs block (50 MiB) of each file they look at. The run's own reader keeps
whole-file requests."""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
from typing import Any

import fsspec
import pytest

from tests.jobs.job_helpers import job_dict
from tests.s3_server import count_fetched, s3_endpoint  # noqa: F401
from tokenmill.io.readers import InputConfig, detect_format, iter_input_rows, list_input_files
from tokenmill.io.readers.compression import PEEK_BLOCK_SIZE
from tokenmill.io.readers.input_fingerprint import EDGE_BYTES, fingerprint_input
from tokenmill.jobs.preflight import check_input
from tokenmill.jobs.spec import coerce_spec

FILES = 20
MiB = 1 << 20
# A look at a file's start reads at most ~260 KB here (its first 20 lines for the format,
# 1,000 for the columns: lines of ~260 bytes) and fetches a block or two past it: bounded well
# under the 3 MB file it fetched whole before (the whole of a larger one, up to 50 MiB).
LOOK_BOUND = 1 * MiB


def _rows(n: int, start: int = 0) -> bytes:
    """``n`` chat rows of ~260 bytes (random letters: they compress as text does)."""
    rng = random.Random(start)
    letters = "abcdefghijklmnopqrstuvwxyz "
    return b"".join(
        json.dumps(
            {
                "id": f"{i:08d}",
                "topic": "t",
                "messages": [{"role": "user", "content": "".join(rng.choices(letters, k=200))}],
            }
        ).encode()
        + b"\n"
        for i in range(start, start + n)
    )


def _spec(options: dict[str, Any], path: str) -> Any:
    spec = job_dict("unused-model", path, "s3://data/out/", output={"format": "parquet"})
    spec["input"]["storage_options"] = options
    spec["output"]["storage_options"] = options
    return coerce_spec(spec)


@pytest.fixture
def twenty_files(s3_endpoint: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any], int]:  # noqa: F811
    """(input path, storage options, bytes per file): 20 JSONL files of ~3 MB on S3."""
    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("data")
    data = _rows(12_000)
    for k in range(FILES):
        fs.pipe_file(f"data/in/part-{k:03d}.jsonl", data)
    return "s3://data/in/", options, len(data)


def test_start_up_checks_fetch_what_they_read_not_whole_files(
    twenty_files: tuple[str, dict[str, Any], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """detect_format and the preflight look at the first file's start; the fingerprint at
    each file's first and last MiB. Before, each look fetched the whole 3 MB file (s3fs's
    50 MiB block): detect_format 3.1 MiB, check_input 6.1, the fingerprint 61 of 61."""
    path, options, size = twenty_files
    cfg = InputConfig(path=path, storage_options=options)
    files = list_input_files(cfg)
    fetched = count_fetched(monkeypatch)

    assert detect_format(files, "auto", options) == "jsonl"
    assert sum(fetched) <= LOOK_BOUND < size

    fetched.clear()
    checked = check_input(_spec(options, path))  # the format again, and the columns
    assert len(checked.files) == FILES
    assert sum(fetched) <= 2 * LOOK_BOUND < size

    fetched.clear()
    assert fingerprint_input(checked).counts == {"files": FILES, "bytes": FILES * size}
    # each file's edges and a block past the first (2.25 MiB a file), and the format's look
    per_file = 2 * EDGE_BYTES + PEEK_BLOCK_SIZE
    assert sum(fetched) <= LOOK_BOUND + FILES * per_file < FILES * size


def test_compressed_input_is_sniffed_from_its_first_compressed_bytes(
    s3_endpoint: tuple[str, dict[str, Any]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A .jsonl.gz file's format and columns come from its first compressed bytes, not from
    the whole file (fetched whole before: 3.6 MB for each of detect_format and the
    preflight's look at its columns)."""
    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("data")
    packed = gzip.compress(_rows(24_000))
    fs.pipe_file("data/gz/rows.jsonl.gz", packed)
    path = "s3://data/gz/"
    fetched = count_fetched(monkeypatch)

    files = list_input_files(InputConfig(path=path, storage_options=options))
    assert detect_format(files, "auto", options) == "jsonl"
    checked = check_input(_spec(options, path))
    assert sum(fetched) <= 2 * LOOK_BOUND < len(packed)
    fetched.clear()
    assert sum(1 for _ in iter_input_rows(checked)) == 24_000  # read through, still whole
    assert sum(fetched) >= len(packed)


def test_the_run_reads_a_file_in_one_request(
    s3_endpoint: tuple[str, dict[str, Any]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run's reader reads whole files: it keeps s3fs's default block (one request for a
    3 MB file), not the start-up looks' small one."""
    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("data")
    data = _rows(12_000)
    fs.pipe_file("data/one/rows.jsonl", data)
    cfg = InputConfig(path="s3://data/one/", storage_options=options, messages_column="messages")
    fetched = count_fetched(monkeypatch)
    assert sum(1 for _ in iter_input_rows(cfg)) == 12_000
    assert len(data) in fetched  # the whole file in one request
    assert sum(fetched) <= len(data) + LOOK_BOUND  # and the look at its format


def _count_requests(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(S3 method, key) of every request s3fs makes from now on."""
    import s3fs.core

    calls: list[tuple[str, str]] = []
    call_s3 = s3fs.core.S3FileSystem._call_s3

    async def counting(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        name = method if isinstance(method, str) else method.__name__
        calls.append((name, kwargs.get("Key", "")))
        return await call_s3(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", counting)
    return calls


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_start_up_reads_each_input_file_once_for_the_fingerprint(
    s3_endpoint: tuple[str, dict[str, Any]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tiny_model: Any,
    kind: str,
) -> None:
    """check_up_front looks at the first file once per thing it needs, and settings_of (the
    fingerprint) reads each file's edges without detecting the format again or asking for
    a file's info twice. Before: the format was detected again (a HEAD and a GET of the
    first file), a Parquet footer read twice, and each single file HEAD-ed twice."""
    from tokenmill.jobs.preflight import check_up_front
    from tokenmill.jobs.runner import settings_of

    _, options = s3_endpoint
    options = {k: v for k, v in options.items() if k != "skip_instance_cache"}  # one client
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("data")
    for k in range(3):
        rows = _rows(20, 20 * k)
        if kind == "parquet":
            import io

            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.Table.from_pylist([json.loads(line) for line in rows.splitlines()])
            table = table.set_column(2, "messages", pa.array(
                [json.dumps(m) for m in table.column("messages").to_pylist()]
            ))  # fmt: skip
            buf = io.BytesIO()
            pq.write_table(table, buf)
            rows = buf.getvalue()
        fs.pipe_file(f"data/in/part-{k}.{kind}", rows)
    for path in ("s3://data/in/", f"s3://data/in/part-0.{kind}"):
        spec = job_dict(tiny_model, path, "s3://data/out/")
        spec["input"] |= {"storage_options": options, "passthrough_columns": ["topic"]}
        spec["output"]["storage_options"] = options
        spec = coerce_spec(spec)
        calls = _count_requests(monkeypatch)
        cfg = check_up_front(spec)
        first = [c for c in calls if c[1] == f"in/part-0.{kind}"]
        # JSONL: the format's first lines and the columns' first rows; Parquet: one footer
        assert [m for m, _ in first].count("get_object") == (2 if kind == "jsonl" else 1)
        calls.clear()
        settings, _ = settings_of(spec, cfg)
        files = len(cfg.files or ())
        assert [m for m, _ in calls].count("get_object") == files, calls  # its edges, once
        assert [m for m, _ in calls].count("head_object") == (1 if files == 1 else 0), calls
        assert settings["input_files"]["files"] == files


def _parquet(table: Any) -> bytes:
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def test_row_total_and_schema_take_the_footers_the_fingerprint_read(
    s3_endpoint: tuple[str, dict[str, Any]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tiny_model: Any,
) -> None:
    """After settings_of, the row count and the passthrough types take each Parquet file's
    footer from the last MiB the fingerprint read (a file of 2 MB too); a footer longer than
    that MiB is read once. Before: every footer read again by each (one GET a file: 2,000
    for a folder of 1,000 files). Both give what reading the files gives."""
    import pyarrow as pa

    from tokenmill.jobs.preflight import check_up_front, output_schema
    from tokenmill.jobs.row_count import input_row_total
    from tokenmill.jobs.runner import settings_of

    _, options = s3_endpoint
    options = {k: v for k, v in options.items() if k != "skip_instance_cache"}  # one client
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("data")
    rng = random.Random(0)
    n = 20_000
    big = pa.table({
        "prompt": ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=120)) for _ in range(n)],
        "topic": pa.array(["a", "b"] * (n // 2)).dictionary_encode(),
    })  # fmt: skip
    wide = pa.table({"prompt": ["p"], "topic": ["t"]} | {f"c{i:05d}": [i] for i in range(9000)})
    files = {
        "part-0.parquet": _parquet(pa.table({"prompt": ["x"] * 5, "topic": ["s"] * 5})),
        "part-1.parquet": _parquet(big),
        "part-2.parquet": _parquet(wide),
    }
    assert len(files["part-1.parquet"]) > EDGE_BYTES  # its end only, in the fingerprint
    footer = int.from_bytes(files["part-2.parquet"][-8:-4], "little")
    assert footer > EDGE_BYTES  # not in the last MiB: read
    for name, data in files.items():
        fs.pipe_file(f"data/in/{name}", data)
    spec = job_dict(tiny_model, "s3://data/in/", "s3://data/out/", output={"format": "parquet"})
    spec["input"] |= {"storage_options": options, "passthrough_columns": ["topic", "absent"]}
    spec["input"] |= {"prompt_column": "prompt", "messages_column": None}
    spec["output"]["storage_options"] = options
    spec = coerce_spec(spec)
    cfg = check_up_front(spec)
    settings_of(spec, cfg)
    calls = _count_requests(monkeypatch)
    schema = output_schema(spec, cfg)
    assert {key for _, key in calls} == {"in/part-2.parquet"}  # the long footer (2 GETs)
    calls.clear()
    total = input_row_total(cfg)
    assert calls == []  # every footer read already
    unkept = dataclasses.replace(cfg, footers=None)
    assert total == input_row_total(unkept) and total is not None and total.rows == n + 6
    assert schema == output_schema(spec, unkept)
    assert {key for _, key in calls} == {f"in/{name}" for name in files}  # (read anew)


def test_a_fresh_run_takes_its_passthrough_types_from_the_footers_the_fingerprint_read(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, tiny_model: Any
) -> None:
    """A fresh run fixed its Parquet schema before it took its fingerprint: the passthrough
    types read every footer but the first (check_input's look) again, one file after
    another, before the fingerprint read the last MiB holding each (a GET a file more on an
    object store). Now none is read for them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenmill import run_job
    from tokenmill.io.readers import parquet_footers

    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(4):
        pq.write_table(pa.table({"prompt": [f"p{i}"], "topic": [f"t{i}"]}), folder / f"{i}.parquet")
    opened: list[str] = []
    records = parquet_footers.ParquetRecords

    def counted(url: str, *args: Any) -> Any:
        opened.append(url)
        return records(url, *args)

    monkeypatch.setattr(parquet_footers, "ParquetRecords", counted)
    spec = job_dict(tiny_model, folder, tmp_path / "out", output={"format": "parquet"})
    spec["input"] |= {"prompt_column": "prompt", "messages_column": None}
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_ok == 4
    assert opened == []
