"""Configured column names the input does not have, before any row runs: JSONL (no schema:
its first objects' keys) as Parquet. A prompt, messages, structured-output or id column in
none of them exits 2 (every row would be a bad row, run unconstrained, or get file:line ids,
in a job that ends "complete"); passthrough columns
in none of them are warned about (null in every row); the default id column may be absent.
A conversations column for a model without a chat template exits 2 as well."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.jobs.job_helpers import job_dict, write_jsonl
from tokenmill.jobs.cli import main as cli_main
from tokenmill.jobs.preflight import check_up_front
from tokenmill.jobs.spec import JobSpec, JobSpecError

ROWS = [{"id": "a", "prompt": "hi", "rule": None, "topic": "t"}, {"id": "b", "prompt": "yo"}]


def _input(tmp_path: Path, fmt: str) -> Path:
    if fmt == "jsonl":
        return write_jsonl(tmp_path / "in.jsonl", ROWS)
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


def _spec(tmp_path: Path, fmt: str, **input_keys: Any) -> dict[str, Any]:
    src = _input(tmp_path, fmt)
    spec = job_dict(Path("unused-model"), src, tmp_path / "out")
    spec["input"] = {"path": str(src), **input_keys}
    return spec


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("structured_output_column", "rul"),
        ("id_column", "ID"),
        ("prompt_column", "promt"),
        ("messages_column", "messages"),
    ],
)
def test_a_column_the_input_lacks_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str, key: str, name: str
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_spec(tmp_path, fmt, **{key: name})))
    assert cli_main([str(job), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"input.{key}: {name!r} is not a " in err, err


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_present_columns_and_the_default_id_pass(tmp_path: Path, fmt: str) -> None:
    check_up_front(JobSpec.from_dict(_spec(tmp_path, fmt, structured_output_column="rule")))
    check_up_front(JobSpec.from_dict(_spec(tmp_path, fmt, id_column="prompt")))
    rows = [{"prompt": "no id here"}]
    src = write_jsonl(tmp_path / "noid.jsonl", rows)
    spec = job_dict(Path("unused-model"), src, tmp_path / "out2")
    spec["input"] = {"path": str(src)}  # id_column: id, the default: file:line ids
    check_up_front(JobSpec.from_dict(spec))


def test_a_jsonl_passthrough_column_in_no_row_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = _spec(tmp_path, "jsonl", passthrough_columns=["topic", "topik"])
    with caplog.at_level(logging.WARNING, logger="tokenmill.jobs"):
        check_up_front(JobSpec.from_dict(spec))
    assert "input.passthrough_columns 'topik': not a key of any of the first 2 rows" in caplog.text
    assert "'topic'" not in caplog.text  # the second row lacks it, the first has it


def test_conversations_for_a_model_without_a_chat_template_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every row would fail "the model has no chat template" and the job exit 0."""
    import json as json_module

    from tests.jobs.job_helpers import chat_rows
    from tests.tiny_models import save_tiny_model

    model = save_tiny_model("llama", tmp_path / "m")
    config = json_module.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json_module.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    src = write_jsonl(tmp_path / "chat.jsonl", chat_rows(2))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(model, src, tmp_path / "out")))
    assert cli_main([str(job), "--quiet"]) == 2
    assert "input.messages_column: model" in capsys.readouterr().err


def test_conversations_for_a_chat_template_that_does_not_compile_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.jobs.job_helpers import chat_rows
    from tests.tiny_models import save_tiny_model

    model = save_tiny_model("llama", tmp_path / "m")
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    src = write_jsonl(tmp_path / "chat.jsonl", chat_rows(2))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(model, src, tmp_path / "out")))
    assert cli_main([str(job), "--quiet"]) == 2
    assert "the chat template 'default' of model" in capsys.readouterr().err


def test_an_empty_first_jsonl_part_file_does_not_turn_the_checks_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Spark writes an empty part file for an empty partition: with it first, a misspelt id
    or constraint column ran every row with file:line ids or unconstrained, exit 0."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "part-00000-a-c000.json").write_text("")
    write_jsonl(folder / "part-00001-a-c000.json", ROWS)
    (folder / "_SUCCESS").write_text("")
    spec = job_dict(Path("unused-model"), folder, tmp_path / "out")
    for key, name in (("id_column", "uid"), ("structured_output_column", "rul")):
        spec["input"] = {"path": str(folder), key: name}
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump(spec))
        assert cli_main([str(job), "--quiet"]) == 2
        assert f"input.{key}: {name!r} is not a key of any of the first 2 rows" in (
            capsys.readouterr().err
        )
    spec["input"] = {"path": str(folder), "passthrough_columns": ["topik"]}
    with caplog.at_level(logging.WARNING, logger="tokenmill.jobs"):
        check_up_front(JobSpec.from_dict(spec))
    assert "'topik': not a key of any of the first 2 rows" in caplog.text


def test_a_parquet_passthrough_column_absent_is_warned_about_for_every_output(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Parquet input, JSONL output: a misspelt passthrough column (or a hive folder key,
    which is not a column) was null in every row without a word; Parquet output warned."""
    spec = _spec(tmp_path, "parquet", passthrough_columns=["topic", "date"])
    with caplog.at_level(logging.WARNING, logger="tokenmill.jobs"):
        check_up_front(JobSpec.from_dict(spec))
    assert "input.passthrough_columns 'date': not a column of" in caplog.text
    assert "hive-style folder keys such as date=... are not read as columns" in caplog.text


def test_an_input_path_message_names_its_key_once(tmp_path: Path) -> None:
    spec = job_dict(Path("unused-model"), tmp_path / "none-*.jsonl", tmp_path / "out")
    with pytest.raises(JobSpecError) as caught:
        check_up_front(JobSpec.from_dict(spec))
    assert str(caught.value).startswith("input.path ")
    assert "matches no files" in str(caught.value)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_an_id_column_in_another_case_is_warned_about_for_every_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fmt: str
) -> None:
    """The default ``id`` absent and ``ID`` present (in a later file, too): its rows get
    "<file>:<row>" ids, so the warning names the column, once a file."""
    from tokenmill.io.readers import InputConfig
    from tokenmill.io.readers.input_rows import iter_input_rows

    folder = tmp_path / "in"
    folder.mkdir()
    parts = [[{"id": "a", "prompt": "hi"}], [{"ID": "b", "prompt": "yo"}]]
    for i, rows in enumerate(parts):
        if fmt == "jsonl":
            write_jsonl(folder / f"part{i}.jsonl", rows)
        else:
            pq.write_table(pa.Table.from_pylist(rows), folder / f"part{i}.parquet")
    cfg = InputConfig(path=str(folder))
    with caplog.at_level(logging.WARNING, logger="tokenmill.jobs"):
        ids = [row.row_id for row in iter_input_rows(cfg)]
        ids_again = [row.row_id for row in iter_input_rows(cfg)]
    assert ids == ids_again and ids[0] == "a" and ids[1].startswith("part1")
    warned = [r.getMessage() for r in caplog.records if "case-sensitive" in r.getMessage()]
    assert len(warned) == 1 and f"part1.{fmt}" in warned[0] and "input.id_column: ID" in warned[0]
