"""Input files as real users produce them, run as whole jobs: byte-order marks, CRLF, no
final newline, blank lines, empty files, keys twice in one object, Parquet prompt columns
of the wrong type, a first line of many megabytes. Bad rows are row errors naming their
``file:line``; a file every row of which would fail exits 2 naming it; a rerun after
completion has nothing to do, and every id is in the output exactly once."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.io.readers.reader_files import batch_line, chat_body, read
from tests.jobs.job_helpers import job_dict, read_jsonl_dir, run_cli, write_job
from tests.tiny_models import save_tiny_model
from tokenmill.io.readers.format_detection import detect_format
from tokenmill.io.readers.jsonl_records import JsonlRecords


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def _row(i: int, **fields: Any) -> bytes:
    return json.dumps({"id": f"r{i}", "prompt": f"hello {i}", **fields}).encode()


def _prompt_job(model: Path, src: Path, folder: Path) -> Path:
    spec = job_dict(model, src, folder / "out")
    spec["input"] = {"path": str(src), "prompt_column": "prompt"}
    return write_job(folder, spec)


def _outcome(out: Path) -> tuple[list[str], dict[str, str]]:
    """(The ids of the output's rows, {id: error} of its error rows)."""
    ok = [r["id"] for r in read_jsonl_dir(out / "shards")]
    errors = {r["id"]: r["error"] for r in read_jsonl_dir(out / "errors")}
    return ok, errors


def test_edge_lines_and_files_run_each_row_once_and_a_rerun_has_nothing_to_do(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in"
    src.mkdir()
    # a mark, CRLF, blank and white-space lines, a list, no final newline
    a = b"\xef\xbb\xbf" + b"\r\n".join([_row(1), b"", b" \t", _row(2), b"[1, 2]", _row(3)])
    (src / "a.jsonl").write_bytes(a)
    (src / "b.jsonl").write_bytes(b"")  # an empty part file among the others
    c = b"\n".join([_row(4), b'{"id": "r5", "prompt": "x\xff"}', b"null", _row(6), b"  ", b""])
    (src / "c.jsonl.gz").write_bytes(gzip.compress(c))
    job = _prompt_job(tiny_model, src, tmp_path)

    assert run_cli(job, "--quiet") == 0
    ok, errors = _outcome(tmp_path / "out")
    assert sorted(ok) == ["r1", "r2", "r3", "r4", "r6"]
    assert sorted(errors) == ["a.jsonl:5", "c.jsonl.gz:2", "c.jsonl.gz:3"]
    assert errors["a.jsonl:5"].startswith(f"{src / 'a.jsonl'}:5: expected a JSON object")
    assert errors["c.jsonl.gz:2"].startswith(f"{src / 'c.jsonl.gz'}:2: line is not valid UTF-8")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (report["rows_ok"], report["rows_failed"], report["rows_total"]) == (5, 3, 8)

    capsys.readouterr()
    assert run_cli(job) == 0
    assert "nothing to do: all 8 rows already committed" in capsys.readouterr().out
    assert _outcome(tmp_path / "out") == (ok, errors)


def test_a_key_twice_in_one_row_is_that_rows_error_naming_the_key(
    tiny_model: Path, tmp_path: Path
) -> None:
    # json.loads keeps the last value without a word: row 2 ran as id "r1"'s duplicate and
    # row 3 with the prompt "second", though other readers take the first
    src = tmp_path / "in.jsonl"
    id_twice = b'{"id": "r2", "prompt": "a", "id": "r1"}'
    prompt_twice = b'{"id": "r3", "prompt": "first", "prompt": "second"}'
    src.write_bytes(b"\n".join([_row(1), id_twice, prompt_twice, _row(4)]) + b"\n")
    assert run_cli(_prompt_job(tiny_model, src, tmp_path), "--quiet") == 0

    ok, errors = _outcome(tmp_path / "out")
    assert sorted(ok) == ["r1", "r4"]
    assert errors == {
        "in.jsonl:2": f"{src}:2: line is ambiguous JSON: key 'id' appears twice in one object "
        "(which value is meant is not defined); keep one of them",
        "in.jsonl:3": f"{src}:3: line is ambiguous JSON: key 'prompt' appears twice in one "
        "object (which value is meant is not defined); keep one of them",
    }


def test_a_key_twice_inside_an_openai_batch_body_is_a_bad_row(tmp_path: Path) -> None:
    good = json.dumps(batch_line("c1", chat_body(max_tokens=4)))
    twice = json.dumps(batch_line("c2", chat_body(max_tokens=4)))
    twice = twice.replace('"max_tokens": 4', '"max_tokens": 4, "max_tokens": 4000')
    src = tmp_path / "batch.jsonl"
    src.write_text(f"{good}\n{twice}\n")

    rows = read(src)
    assert [(r.custom_id, r.error) for r in rows[:1]] == [("c1", None)]
    assert rows[1].error is not None and "key 'max_tokens' appears twice" in rows[1].error
    assert rows[1].source == f"{src}:2"


@pytest.mark.parametrize(
    "prompts",
    [pa.array([1, 2], pa.int64()), pa.array([[1], [2]]), pa.array([True, False])],
    ids=["int64", "list", "bool"],
)
def test_a_parquet_prompt_column_that_cannot_hold_text_exits_2_naming_the_file(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], prompts: pa.Array
) -> None:
    # every row was a "bad prompt" row error and the job exited 0 "complete"
    src = tmp_path / "in"
    src.mkdir()
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": prompts}), src / "a.parquet")

    assert run_cli(_prompt_job(tiny_model, src, tmp_path), "--quiet") == 2
    err = capsys.readouterr().err
    assert f"input.prompt_column: column 'prompt' of {src / 'a.parquet'} is of type " in err
    assert "cannot hold text; name the column that holds them, or cast this one to string" in err
    assert not (tmp_path / "out" / "shards").exists()


def test_parquet_text_prompts_of_every_string_type_and_null_prompts_run(
    tiny_model: Path, tmp_path: Path
) -> None:
    src = tmp_path / "in"
    src.mkdir()
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.int64())}),
                   src / "a.parquet")  # fmt: skip
    prompts = pa.array(["x", None, "z", "w"], pa.large_string()).dictionary_encode()
    pq.write_table(pa.table({"id": ["p1", "p2", "p3", "p4"], "prompt": prompts}), src / "b.parquet",
                   row_group_size=2)  # fmt: skip
    assert run_cli(_prompt_job(tiny_model, src, tmp_path), "--quiet") == 0

    ok, errors = _outcome(tmp_path / "out")
    assert sorted(ok) == ["p1", "p3", "p4"]
    assert list(errors) == ["p2"]
    assert errors["p2"].startswith(f"{src / 'b.parquet'}:1: missing prompt")


def test_format_detection_reads_a_long_first_line_in_linear_time(tmp_path: Path) -> None:
    # Each 64 KiB block re-split the whole line read so far: 1.7-3.0 s for this file (three
    # calls a run), against 0.06 s now and 0.09 s to read the file through its records.
    src = tmp_path / "long.jsonl"
    src.write_bytes(_row(1, topic="x" * (20 << 20)) + b"\n" + _row(2) + b"\n")
    start = time.perf_counter()
    with JsonlRecords(str(src), {}) as records:
        assert [r.position for r in records] == [1, 2]
    read_s = time.perf_counter() - start

    start = time.perf_counter()
    assert detect_format([str(src)], "auto") == "jsonl"
    detect_s = time.perf_counter() - start
    # the reader parses all 20 MiB, detection splits 16: a linear scan is no slower (the
    # quadratic one was 15x; the margin is for a loaded machine)
    assert detect_s < 5 * read_s + 0.2, f"detect {detect_s:.3f} s, read {read_s:.3f} s"
