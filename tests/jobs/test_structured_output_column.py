"""Per-row constraints in plain jobs: ``input.structured_output_column`` names a column whose
value constrains that row (JSON schema, json_object, regex, choice) or, null, leaves it to
``sampling.structured_output``. Each row gets its own: JSON rows validate (jsonschema), regex
rows match in full, choice rows are one of theirs, unconstrained rows are what the model
writes alone; bad values are their rows' errors, naming the column."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.jobs.job_helpers import (
    chat_rows,
    job_dict,
    read_jsonl_dir,
    run_cli,
    write_job,
    write_jsonl,
)
from tokenmill import LLM, SamplingParams, run_job
from tokenmill.engine.seeds import input_row_seed
from tokenmill.io.readers import InputConfig
from tokenmill.io.readers.input_fingerprint import input_fingerprint

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "n"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
CHOICES = ["red", "green", "blue", "light blue"]
SAMPLING = {"max_tokens": 40, "temperature": 0.8, "seed": 7}

# id suffix -> the row's constraint cell
CELLS: dict[str, Any] = {
    "schema": {"json_schema": SCHEMA},
    "schema-text": json.dumps({"json_schema": SCHEMA}),  # as a Parquet string cell holds it
    "regex": {"regex": DATE},
    "choice": {"choice": CHOICES},
    "object": "json_object",
    "none": None,
}
BAD_CELLS: dict[str, tuple[Any, str]] = {
    "bad-regex": ({"regex": "[0-9"}, "regex: cannot compile this regex '[0-9'"),
    "empty-choice": ({"choice": []}, "choice must list at least one string"),
    "two-keys": ({"regex": "a", "choice": ["a"]}, "a mapping with one key"),
}


def _check(row: dict[str, Any], kind: str) -> None:
    text = row["text"]
    if kind == "none":  # compared with the model's own output below
        return
    if kind == "object":  # any object: a random model may wander in a string till the end
        assert text.startswith("{")
        if row["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
        return
    assert row["finish_reason"] == "stop", (kind, text)
    if kind.startswith("schema"):
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(DATE, text), text
    elif kind == "choice":
        assert text in CHOICES


def test_jsonl_rows_each_get_their_own_constraint(tiny_model: Path, tmp_path: Path) -> None:
    kinds = [*CELLS, *BAD_CELLS]
    rows = [
        {**row, "id": f"{row['id']}-{kind}", "constraint": {**CELLS, **bad}[kind]}
        for row, kind in zip(chat_rows(len(kinds)), kinds, strict=True)
        for bad in [{k: v[0] for k, v in BAD_CELLS.items()}]
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    spec = job_dict(tiny_model, src, tmp_path / "out", sampling=SAMPLING)
    spec["input"]["structured_output_column"] = "constraint"
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (len(CELLS), len(BAD_CELLS))

    done = {r["id"]: r for r in read_jsonl_dir(tmp_path / "out" / "shards")}
    for rid, row in done.items():
        _check(row, rid.split("-", 1)[1])
    # Unconstrained rows: what the model writes for them alone, with the job's sampling.
    llm = LLM(str(tiny_model), device="cpu", kv_cache_memory=16 << 20)
    free = [(i, r) for i, r in enumerate(rows) if r["constraint"] is None]
    alone = [  # each row's seed: the job's mixed with the row's index
        llm.chat(r["messages"], SamplingParams(**SAMPLING | {"seed": input_row_seed(7, i)}))[0]
        for i, r in free
    ]
    assert [done[r["id"]]["text"] for _, r in free] == [o.text for o in alone]

    errors = {r["id"]: r["error"] for r in read_jsonl_dir(tmp_path / "out" / "errors")}
    assert {rid.split("-", 1)[1] for rid in errors} == set(BAD_CELLS)
    for rid, error in errors.items():
        assert error.startswith(f"{src}:") and "column 'constraint'" in error, error
        assert BAD_CELLS[rid.split("-", 1)[1]][1] in error, error


def test_parquet_text_column_overrides_the_job_constraint(tiny_model: Path, tmp_path: Path) -> None:
    """A string column (JSON text, json_object, null): null rows take the job's
    ``sampling.structured_output`` (a choice list), the others their own."""
    cells = [json.dumps({"regex": DATE}), None, "json_object", None, json.dumps(CELLS["choice"])]
    kinds = ["regex", "job", "object", "job", "choice"]
    table = pa.table(
        {
            "id": [f"p{i}" for i in range(len(cells))],
            "prompt": [f"Row {i} says:" for i in range(len(cells))],
            "rule": pa.array(cells, pa.string()),
        }
    )
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    spec = job_dict(tiny_model, src, tmp_path / "out", sampling=SAMPLING)
    spec["input"] = {"path": str(src), "structured_output_column": "rule"}
    spec["sampling"]["structured_output"] = {"choice": ["yes", "no"]}
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_ok == len(cells)
    done = {r["id"]: r for r in read_jsonl_dir(tmp_path / "out" / "shards")}
    for i, kind in enumerate(kinds):
        row = done[f"p{i}"]
        if kind == "job":
            assert row["text"] in ("yes", "no") and row["finish_reason"] == "stop"
        else:
            _check(row, kind)


def test_a_column_the_input_cannot_have_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parquet = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a"], "prompt": ["hi"]}), parquet)
    spec = job_dict(Path("unused-model"), parquet, tmp_path / "out")
    spec["input"] = {"path": str(parquet), "structured_output_column": "rulez"}
    assert run_cli(write_job(tmp_path, spec), "--quiet") == 2
    err = capsys.readouterr().err
    assert "input.structured_output_column: 'rulez' is not a column of" in err, err

    batch = write_jsonl(
        tmp_path / "batch.jsonl",
        [{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}],
    )
    spec["input"] = {"path": str(batch), "structured_output_column": "rule"}
    spec["output"]["format"] = "openai-batch"
    assert run_cli(write_job(tmp_path, spec), "--quiet") == 2
    err = capsys.readouterr().err
    assert "input.structured_output_column: OpenAI Batch input" in err, err
    assert not (tmp_path / "out").exists()


def test_the_column_is_part_of_the_input_fingerprint(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    plain = input_fingerprint(InputConfig(path=str(src), messages_column="messages"))
    ruled = input_fingerprint(
        InputConfig(path=str(src), messages_column="messages", structured_output_column="c")
    )
    assert plain != ruled


def test_a_constraint_only_xgrammar_refuses_names_its_column(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The reader checks a cell as llguidance reads it; one that xgrammar (the job's
    library) refuses was the row's error naming SamplingParams.structured_output, which no
    input has. Now it names the column, in a run and in a dry run."""
    pytest.importorskip("xgrammar")
    from tokenmill.jobs.dry_run import dry_run
    from tokenmill.jobs.spec import JobSpec

    rows = chat_rows(2)
    rows[0]["constraint"] = {"regex": "[a-z&&[^aeiou]]{3}"}  # a class set operation
    rows[1]["constraint"] = {"choice": ["yes", "no"]}
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    spec = job_dict(tiny_model, src, tmp_path / "out", sampling=SAMPLING)
    spec["input"]["structured_output_column"] = "constraint"
    spec["engine"]["structured_output_backend"] = "xgrammar"
    want = "column 'constraint': xgrammar cannot use this regex: the regex uses '&&'"
    estimate = dry_run(JobSpec.from_dict(spec))
    assert estimate.bad_rows == 1 and want in estimate.bad_examples[0][1]
    report = run_job(spec, show_progress=False)
    assert (report.rows_ok, report.rows_failed) == (1, 1)
    (error,) = [r["error"] for r in read_jsonl_dir(tmp_path / "out" / "errors")]
    assert want in error and "SamplingParams" not in error
