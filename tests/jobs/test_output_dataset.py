"""A job's output as readers see it: the shards are one dataset, errors only where rows failed.

    out/shards/part-*.parquet   one schema for the whole job, fixed before the first shard
    out/errors/part-*.jsonl     only for shards with bad rows
    out/<job>.manifest.json     records the schema; resumes keep it

pyarrow.dataset, duckdb and polars read ``out/shards`` with no options, whatever the passthrough
values of each shard (null in one, float in the next), and a value that does not fit the
job's type is its row's error, not a crash or a changed type.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from tests.jobs.job_helpers import chat_rows, job_dict, read_jsonl_dir, write_jsonl
from tokenmill import run_job
from tokenmill.io.readers import passthrough_types
from tokenmill.jobs import preflight
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.spec import JobSpec, JobSpecError


def _read_as_one_dataset(out: Path) -> list[dict[str, Any]]:
    """The shards read by pyarrow.dataset, duckdb and polars, no options; all must agree
    (polars takes the first file's schema and refuses a shard whose types differ)."""
    by_arrow = sorted(ds.dataset(out / "shards").to_table().to_pylist(), key=lambda r: r["id"])
    result = duckdb.connect().sql(f"SELECT * FROM '{out}/shards/*.parquet' ORDER BY id")
    by_duckdb = [dict(zip(result.columns, row, strict=True)) for row in result.fetchall()]
    assert by_arrow == by_duckdb
    by_polars = pl.read_parquet(out / "shards").sort("id").to_dicts()
    assert by_polars == by_arrow
    return by_arrow


def _one_schema(out: Path) -> pa.Schema:
    schemas = [pq.read_schema(p) for p in sorted((out / "shards").glob("*.parquet"))]
    assert len(schemas) > 1 and all(s.equals(schemas[0]) for s in schemas)
    return schemas[0]


def _sparse_rows(n: int, null_below: int) -> list[dict[str, Any]]:
    rows = chat_rows(n)
    for i, row in enumerate(rows):
        row["topic"] = None if i < null_below else i + 0.5
    return rows


def _parquet_job(model: Path, src: Path, out: Path, **sections: Any) -> dict[str, Any]:
    return job_dict(model, src, out, output={"format": "parquet", "rows_per_shard": 4}, **sections)


def test_jsonl_passthrough_null_in_the_first_shard_and_float_later(
    tiny_model: Path, tmp_path: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", _sparse_rows(12, null_below=5))
    out = tmp_path / "out"
    report = run_job(_parquet_job(tiny_model, src, out), show_progress=False)
    assert (report.status, report.rows_ok, report.rows_failed) == ("complete", 12, 0)
    assert _one_schema(out).field("topic").type == pa.float64()
    rows = _read_as_one_dataset(out)
    assert [r["topic"] for r in rows] == [None] * 5 + [i + 0.5 for i in range(5, 12)]
    assert not (out / "errors").exists() or not any((out / "errors").iterdir())
    manifest = json.loads((out / "test.manifest.json").read_text())
    assert manifest["output_schema"]["passthrough"] == {"topic": "double"}
    assert all(s["error_file"] is None for s in manifest["shards"].values())


def test_parquet_input_keeps_its_types_across_files(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    rows = _sparse_rows(10, null_below=4)
    for name, part in (("a", rows[:4]), ("b", rows[4:])):
        table = pa.Table.from_pylist(part)
        if name == "a":  # all null here: the file's own type for the column is null
            assert table.schema.field("topic").type == pa.null()
        pq.write_table(table, folder / f"{name}.parquet")
    out = tmp_path / "out"
    report = run_job(_parquet_job(tiny_model, folder, out), show_progress=False)
    assert (report.status, report.rows_ok) == ("complete", 10)
    assert _one_schema(out).field("topic").type == pa.float64()
    assert [r["topic"] for r in _read_as_one_dataset(out)] == [r["topic"] for r in rows]


def test_a_later_jsonl_value_that_does_not_fit_is_a_row_error(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(passthrough_types, "SAMPLE_ROWS", 4)
    rows = chat_rows(10)
    for i, row in enumerate(rows):
        row["topic"] = i
    rows[6]["topic"], rows[9]["topic"] = "seven", 9.5
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    spec = _parquet_job(tiny_model, src, out)
    report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_ok, report.rows_failed) == ("complete", 8, 2)
    assert _one_schema(out).field("topic").type == pa.int64()
    assert [r["id"] for r in _read_as_one_dataset(out)] == [
        r["id"] for i, r in enumerate(rows) if i not in (6, 9)
    ]
    assert sorted(p.name for p in (out / "errors").iterdir()) == [
        "part-00001.jsonl",
        "part-00002.jsonl",
    ]
    errors = {e["id"]: e["error"] for e in read_jsonl_dir(out / "errors")}
    assert set(errors) == {"r0006", "r0009"}
    assert errors["r0006"].startswith(f"{src}:7: passthrough column 'topic' holds 'seven'")
    assert "int64 (inferred from the first 4 input rows)" in errors["r0009"]
    assert "input.passthrough_columns" in errors["r0009"]
    assert dry_run(JobSpec.from_dict(spec)).bad_rows == 2


def test_error_files_only_for_shards_with_bad_rows(tiny_model: Path, tmp_path: Path) -> None:
    lines = [json.dumps(r) for r in chat_rows(12)]
    lines.insert(6, "{not json")  # row 6: shard 1
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    report = run_job(job_dict(tiny_model, src, out), show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (12, 1)
    assert [p.name for p in (out / "errors").iterdir()] == ["part-00001.jsonl"]
    shards = json.loads((out / "test.manifest.json").read_text())["shards"]
    assert [s["error_file"] for s in shards.values()] == [
        None,
        "errors/part-00001.jsonl",
        None,
        None,
    ]
    assert run_job(job_dict(tiny_model, src, out), show_progress=False).rows_failed == 1


def test_a_jsonl_shard_without_good_rows_writes_no_data_file(
    tiny_model: Path, tmp_path: Path
) -> None:
    """An empty .jsonl shard (every row of it bad) failed pyarrow.dataset over the folder
    ("Empty JSON stream") and polars.read_ndjson; such a shard now has only its error file.
    An earlier version's empty data file is unlisted and deleted on the next run."""
    lines = [json.dumps(r) for r in chat_rows(12)]
    lines[4:8] = ["{not json"] * 4  # shard 1: all bad
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out)
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (8, 4)
    names = sorted(p.name for p in (out / "shards").iterdir())
    assert names == ["part-00000.jsonl", "part-00002.jsonl"]
    assert ds.dataset(out / "shards", format="json").count_rows() == 8
    assert pl.read_ndjson(out / "shards" / "*.jsonl").height == 8
    manifest = json.loads((out / "test.manifest.json").read_text())
    assert manifest["shards"]["1"]["data"] is None and manifest["shards"]["1"]["errors"] == 4
    again = run_job(spec, show_progress=False)  # resumes: nothing missing, nothing recomputed
    assert (again.status, again.shards_recomputed, again.rows_this_run) == ("complete", 0, 0)

    # as an earlier version left it: an empty data file, named in the manifest
    manifest["shards"]["1"]["data"], manifest["shards"]["1"]["data_bytes"] = (
        "shards/part-00001.jsonl",
        0,
    )
    (out / "test.manifest.json").write_text(json.dumps(manifest))
    (out / "shards" / "part-00001.jsonl").write_bytes(b"")
    again = run_job(spec, show_progress=False)
    assert (again.status, again.shards_recomputed, again.rows_ok) == ("complete", 0, 8)
    assert not (out / "shards" / "part-00001.jsonl").exists()
    saved = json.loads((out / "test.manifest.json").read_text())["shards"]["1"]
    assert saved["data"] is None


def _as_an_earlier_version_left_it(out: Path, topics: dict[int, pa.Array]) -> None:
    """The output as an earlier tokenmill wrote it: no schema in the manifest, an empty error
    file for every shard, each shard's own passthrough types (``topics``: shard -> its topic
    column), and killed after shard 1 with shard 2's error file written but not recorded."""
    manifest_path = out / "test.manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["output_schema"], manifest["shards"]["2"]
    manifest["complete"], manifest["total_rows"] = False, None
    for index, topic in topics.items():
        shard = manifest["shards"][str(index)]
        path = out / shard["data"]
        table = pq.read_table(path)
        table = table.set_column(table.schema.get_field_index("topic"), "topic", topic)
        pq.write_table(table, path)
        shard["data_bytes"] = path.stat().st_size
    for index, shard in manifest["shards"].items():
        shard["error_file"], shard["error_bytes"] = f"errors/part-0000{index}.jsonl", 0
        write_jsonl(out / shard["error_file"], [])
    write_jsonl(out / "errors" / "part-00002.jsonl", [{"id": "r0009", "error": "stale"}])
    manifest_path.write_text(json.dumps(manifest))


def test_a_job_of_the_earlier_layout_resumes_into_one_schema(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", _sparse_rows(12, null_below=5))
    out = tmp_path / "out"
    spec = _parquet_job(tiny_model, src, out)
    run_job(spec, show_progress=False)
    # shard 0's topics are all null: an earlier version typed that column null there
    _as_an_earlier_version_left_it(out, {0: pa.array([None] * 4, pa.null())})
    assert pq.read_schema(out / "shards" / "part-00000.parquet").field("topic").type == pa.null()

    with caplog.at_level(logging.WARNING, logger="tokenmill.jobs"):
        report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_this_run, report.rows_ok) == ("complete", 4, 12)
    assert "earlier tokenmill" not in caplog.text  # every old shard was brought to the schema
    assert not any((out / "errors").iterdir())  # empty and stray error files are gone
    manifest = json.loads((out / "test.manifest.json").read_text())
    assert all(s["error_file"] is None for s in manifest["shards"].values())
    assert manifest["output_schema"]["passthrough"] == {"topic": "double"}
    assert _one_schema(out).field("topic").type == pa.float64()
    assert [r["topic"] for r in _read_as_one_dataset(out)] == [None] * 5 + [
        i + 0.5 for i in range(5, 12)
    ]
    again = run_job(spec, show_progress=False)  # the rewritten shard's size was recorded
    assert (again.status, again.shards_recomputed, again.rows_this_run) == ("complete", 0, 0)


def test_an_earlier_shard_whose_values_would_change_is_kept_with_a_warning(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = chat_rows(12)
    for i, row in enumerate(rows):
        row["topic"] = i
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    spec = _parquet_job(tiny_model, src, out)
    run_job(spec, show_progress=False)
    # an earlier version's mixed-type fallback: the numbers as strings
    _as_an_earlier_version_left_it(out, {1: pa.array(["4", "5", "6", "7"])})
    with caplog.at_level(logging.WARNING, logger="tokenmill.jobs"):
        report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_ok) == ("complete", 12)
    assert "1 shards committed by an earlier tokenmill keep passthrough column types" in caplog.text
    assert "topic: int64" in caplog.text and "--fresh" in caplog.text
    assert pq.read_table(out / "shards" / "part-00001.parquet").column("topic").to_pylist() == [
        "4",
        "5",
        "6",
        "7",
    ]


def test_a_resume_writes_the_schema_the_first_run_fixed(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", _sparse_rows(12, null_below=2))
    out = tmp_path / "out"
    spec = _parquet_job(tiny_model, src, out)
    run_job(spec, show_progress=False)
    (out / "shards" / "part-00000.parquet").unlink()  # its rows: topic all null

    def no_second_guess(cfg: Any) -> None:
        raise AssertionError("the schema was decided again on resume")

    monkeypatch.setattr(preflight, "passthrough_schema", no_second_guess)
    report = run_job(spec, show_progress=False)
    assert (report.status, report.shards_recomputed, report.rows_this_run) == ("complete", 1, 4)
    assert _one_schema(out).field("topic").type == pa.float64()
    assert len(_read_as_one_dataset(out)) == 12


def test_parquet_inputs_whose_types_do_not_combine_stop_before_any_shard(
    tiny_model: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    rows = chat_rows(4)
    for i, row in enumerate(rows):
        row["topic"] = i if i < 2 else f"t{i}"
    pq.write_table(pa.Table.from_pylist(rows[:2]), folder / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:]), folder / "b.parquet")
    out = tmp_path / "out"
    spec = _parquet_job(tiny_model, folder, out)
    with pytest.raises(JobSpecError, match="input.passthrough_columns: column 'topic' is int64"):
        run_job(spec, show_progress=False)
    assert not (out / "shards").exists()
    with pytest.raises(JobSpecError, match="b.parquet"):
        dry_run(JobSpec.from_dict(spec))


def test_a_job_without_rows_leaves_a_dataset_to_open(tiny_model: Path, tmp_path: Path) -> None:
    """No input rows: no shard, but shards/ is there, so the documented read gives no rows
    instead of FileNotFoundError."""
    src = write_jsonl(tmp_path / "in.jsonl", [])
    out = tmp_path / "out"
    assert run_job(_parquet_job(tiny_model, src, out), show_progress=False).rows_total == 0
    assert ds.dataset(out / "shards").to_table().num_rows == 0


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_uuid_ids_and_columns_as_duckdb_writes_them(tiny_model: Path, tmp_path: Path, fmt) -> None:
    """DuckDB (and Spark) write UUID columns that pyarrow reads as UUIDs: as the id column
    every row failed ("must hold a string or an integer, got UUID"), and as a passthrough
    column of a Parquet job every row failed (its 16-byte storage refused the UUIDs)."""
    src = tmp_path / "in.parquet"
    duckdb.connect().sql(
        "COPY (SELECT uuid() AS id, uuid() AS ref, 'say ' || i::VARCHAR AS prompt "
        f"FROM range(6) t(i)) TO '{src}' (FORMAT parquet)"
    )
    given = {str(r["id"]): r["ref"] for r in pq.read_table(src).to_pylist()}
    spec = job_dict(tiny_model, src, tmp_path / "out", output={"format": fmt})
    spec["input"] |= {"prompt_column": "prompt", "messages_column": None}
    spec["input"]["passthrough_columns"] = ["ref"]
    report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_ok, report.rows_failed) == ("complete", 6, 0)
    out = tmp_path / "out"
    if fmt == "jsonl":
        got = {r["id"]: r["ref"] for r in read_jsonl_dir(out / "shards")}
        assert got == {rid: str(ref) for rid, ref in given.items()}
        return
    assert pq.read_schema(next((out / "shards").glob("*.parquet"))).field("ref").type == pa.uuid()
    rows = duckdb.connect().sql(f"SELECT id, ref FROM '{out}/shards/*.parquet'").fetchall()
    assert {rid: ref for rid, ref in rows} == given  # DuckDB reads them back as UUIDs
