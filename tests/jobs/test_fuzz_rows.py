"""Fuzzing whole jobs with malformed input lines: no crash, every row accounted for once.

    Fuzzer(seed) ──► lines (bytes) tagged good | bad(category) | blank, spread over
        in/a.jsonl, in/b.jsonl.gz, in/c.ndjson (rows in that order; line 1 of each is good)
    run_job ──► shards/part-*.{jsonl,parquet} + errors/part-*.jsonl ──► _check_job
    dry_run ──► bad_rows == report.rows_failed

The contract checked: the job completes; each good row's id is in the shards once and in no
error file; each malformed line is in the error files once, its message starting with its
``<file>:<line>: `` location once; output files are UTF-8 and parse; Parquet shards read
back as one dataset (pyarrow.dataset, duckdb, no options). Every malformed line is built to
be invalid for one clear reason; blank lines are not rows. A row claims its id even when it
is bad, so a later row with that id is a duplicate.

The tests at the end pin, one each, the bugs this fuzz found.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from tests.jobs.fuzz_lines import (
    BATCH_CATEGORIES,
    MAX_TOKENS,
    PLAIN_CATEGORIES,
    RAW_CATEGORIES,
    Fuzzer,
    Line,
    write_input,
)
from tests.jobs.job_helpers import job_dict, read_jsonl_dir
from tokenmill import run_job
from tokenmill.io.storage import OutputStore
from tokenmill.io.writers import read_results
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.spec import JobSpec


def _read_jsonl_strict(path: Path) -> list[Any]:
    """Every line of a JSONL file; fails unless it is UTF-8 and each line is strict JSON (no
    bare NaN / Infinity). Splits on \\n only: U+2028 and U+0085 may sit unescaped inside
    strings."""
    text = path.read_bytes().decode("utf-8")

    def refuse(token: str) -> None:
        raise AssertionError(f"{path}: {token} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in text.split("\n") if line.strip()]


def _check_job(
    spec: dict[str, Any], folder: Path, plan: dict[str, list[Line]], batch: bool
) -> dict[str, int]:
    """Run the job and its dry run; assert the contract. Returns the categories' counts."""
    report = run_job(spec, show_progress=False)
    out = Path(spec["output"]["path"])
    lines = [(name, no, line) for name, ls in plan.items() for no, line in enumerate(ls, 1)]
    good = Counter(line.row_id for _, _, line in lines if line.kind == "good")
    bad = Counter(f"{folder / name}:{no}" for name, no, line in lines if line.kind == "bad")
    assert len(good) == sum(good.values()) >= 100 and len(bad) >= 250

    assert report.status == "complete"
    assert (report.rows_ok, report.rows_failed) == (len(good), len(bad))
    assert report.rows_total == report.rows_ok + report.rows_failed

    fmt = spec["output"]["format"]
    shard_files = sorted(
        (out / "shards").glob("part-*.parquet" if fmt == "parquet" else "part-*.jsonl")
    )
    assert shard_files and len(shard_files) == len(list((out / "shards").iterdir()))
    if fmt == "parquet":
        rows = [r for f in shard_files for r in pq.read_table(f).to_pylist()]
        assert ds.dataset(out / "shards").count_rows() == len(rows)
        query = f"SELECT count(*) FROM '{out}/shards/*.parquet'"
        assert duckdb.connect().sql(query).fetchall() == [(len(rows),)]
    else:
        rows = [r for f in shard_files for r in _read_jsonl_strict(f)]
    ok_ids = Counter(r["custom_id"] if batch else r["id"] for r in rows)
    assert ok_ids == good, "good rows missing, repeated or joined by bad ones"
    if fmt == "jsonl":  # passthrough values come back as they went in, in strict JSON
        topics = {line.row_id: line.topic for _, _, line in lines if line.kind == "good"}
        assert all(json.dumps(r["topic"]) == json.dumps(_finite(topics[r["id"]])) for r in rows)
    for r in rows:
        if batch:
            assert r["error"] is None and r["response"]["status_code"] == 200
        usage = r["response"]["body"]["usage"] if batch else r
        assert usage["completion_tokens"] <= MAX_TOKENS

    errors = [
        r for f in sorted((out / "errors").glob("part-*.jsonl")) for r in _read_jsonl_strict(f)
    ]
    error_ids = {r["custom_id"] if batch else r["id"] for r in errors}
    assert not error_ids & set(good), "a good row's id is in the error files"
    found: Counter[str] = Counter()
    for r in errors:
        message = r["error"]["message"] if batch else r["error"]
        if batch:
            assert r["response"] is None and r["error"]["code"] and r["custom_id"]
        location, sep, reason = message.partition(": ")
        assert sep and reason.strip(), f"error without a reason: {message!r}"
        url = location.rsplit(":", 1)[0]
        assert message.count(url) == 1, f"location repeated: {message!r}"
        found[location] += 1
    assert found == bad, "bad lines missing from the error files, or there more than once"

    checked = dry_run(JobSpec.from_dict(spec))
    assert (checked.rows, checked.bad_rows) == (report.rows_total, report.rows_failed)
    return dict(Counter(line.category for _, _, line in lines if line.kind == "bad"))


def _spec(model: Path, folder: Path, out: Path, fmt: str) -> dict[str, Any]:
    return job_dict(
        model,
        folder,
        out,
        output={"format": fmt, "rows_per_shard": 53},
        sampling={"max_tokens": MAX_TOKENS},
        engine={"max_num_seqs": 16},
    )


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_fuzzed_chat_rows(tiny_model: Path, tmp_path: Path, fmt: str) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    fuzzer = Fuzzer(seed=1234, batch=False)
    plan = write_input(folder, fuzzer, n_good=150, n_bad=1050)
    counts = _check_job(_spec(tiny_model, folder, tmp_path / "out", fmt), folder, plan, False)
    assert sum(counts.values()) >= 1000 and set(counts) == set(RAW_CATEGORIES + PLAIN_CATEGORIES)


def test_fuzzed_openai_batch_lines(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    plan = write_input(folder, Fuzzer(seed=99, batch=True), n_good=110, n_bad=450)
    spec = _spec(tiny_model, folder, tmp_path / "out", "openai-batch")
    # (no passthrough: OpenAI Batch output has no place for it, and refuses it)
    spec["input"] = {"path": str(folder), "format": "auto"}
    counts = _check_job(spec, folder, plan, True)
    assert set(counts) == set(RAW_CATEGORIES + BATCH_CATEGORIES)


# -- the bugs the fuzz found, one test each ------------------------------------------------


def _good_line(row_id: str, **extra: Any) -> dict[str, Any]:
    return {"id": row_id, "messages": [{"role": "user", "content": "hi"}], **extra}


def _run_lines(
    model: Path, tmp_path: Path, lines: list[str], fmt: str = "jsonl", rows_per_shard: int = 1
) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    spec = _spec(model, folder, out, fmt)
    spec["output"]["rows_per_shard"] = rows_per_shard
    report = run_job(spec, show_progress=False)
    assert report.status == "complete"
    return out


def test_parquet_passthrough_empty_object_is_written(tiny_model: Path, tmp_path: Path) -> None:
    lines = [json.dumps(_good_line("r0")), json.dumps(_good_line("r1", topic={}))]
    out = _run_lines(tiny_model, tmp_path, lines, "parquet", rows_per_shard=2)
    table = pq.read_table(out / "shards" / "part-00000.parquet")
    assert table.column("id").to_pylist() == ["r0", "r1"]


def test_row_refused_for_surrogates_still_claims_its_id(tiny_model: Path, tmp_path: Path) -> None:
    lines = [
        json.dumps(_good_line("r0")),
        '{"id": "x", "messages": [{"role": "user", "content": "\\ud800"}]}',
        json.dumps(_good_line("x")),
    ]
    out = _run_lines(tiny_model, tmp_path, lines)
    assert [r["id"] for r in read_jsonl_dir(out / "shards")] == ["r0"]


_DEEP_SURROGATE = (
    '{"id": "x", "messages": [{"role": "user", "content": "hi"}], "topic": '
    + "[" * 250 + '"\\ud800"' + "]" * 250 + "}"
)  # fmt: skip


def test_unwritable_row_error_names_its_line(tiny_model: Path, tmp_path: Path) -> None:
    out = _run_lines(tiny_model, tmp_path, [json.dumps(_good_line("r0")), _DEEP_SURROGATE])
    [error] = read_jsonl_dir(out / "errors")
    assert error["error"].startswith(f"{tmp_path / 'in' / 'a.jsonl'}:2: ")


def test_dry_run_counts_rows_the_writer_refuses(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps(_good_line("r0")) + "\n" + _DEEP_SURROGATE + "\n")
    spec = _spec(tiny_model, folder, tmp_path / "out", "jsonl")
    assert (
        dry_run(JobSpec.from_dict(spec)).bad_rows == run_job(spec, show_progress=False).rows_failed
    )


def test_parquet_shards_read_back_as_one_dataset(tiny_model: Path, tmp_path: Path) -> None:
    lines = [json.dumps(_good_line("r0")), json.dumps(_good_line("r1", topic=5))]
    out = _run_lines(tiny_model, tmp_path, lines, "parquet")
    assert pq.read_table(out / "shards").column("topic").to_pylist() == [None, 5]


def test_read_results_reads_back_line_separators(tiny_model: Path, tmp_path: Path) -> None:
    out = _run_lines(tiny_model, tmp_path, [json.dumps(_good_line("r0", topic="a\u2028b\x85c"))])
    [row] = read_results(OutputStore(str(out)), ["shards/part-00000.jsonl"], "jsonl")
    assert row["topic"] == "a\u2028b\x85c"


def _finite(value: Any) -> Any:
    """``value`` as strict JSON holds it: NaN and infinities as null, at any depth."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
