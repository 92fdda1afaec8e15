"""A folder input reads every file below it but hidden ones: a file whose name says no format
is read as input.format says, or refused by name, never left out without a word."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.jobs.job_helpers import chat_rows, job_dict, read_jsonl_dir, write_jsonl
from tokenmill import run_job
from tokenmill.jobs.cli import main as cli_main


def _folder(tmp_path: Path) -> Path:
    """A Hadoop text export's ``part-00000`` (no suffix), a .jsonl file and Spark's markers."""
    data = tmp_path / "data"
    write_jsonl(data / "part-00000", chat_rows(3))
    write_jsonl(data / "sub" / "b.jsonl", chat_rows(2, start=3))
    (data / "_SUCCESS").write_text("")
    (data / ".part-00000.crc").write_bytes(b"\x00crc")
    return data


def test_a_file_with_no_format_in_its_name_is_refused_by_name(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was left out: exit 0 with the rows of the .jsonl files alone."""
    spec = job_dict(tiny_model, _folder(tmp_path), tmp_path / "out")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    assert cli_main([str(job)]) == 2
    err = capsys.readouterr().err
    assert "part-00000" in err and "input.format" in err, err
    assert not (tmp_path / "out" / "shards").exists()


def test_input_format_reads_it(tiny_model: Path, tmp_path: Path) -> None:
    spec = job_dict(tiny_model, _folder(tmp_path), tmp_path / "out")
    spec["input"]["format"] = "jsonl"
    report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_ok, report.rows_failed) == ("complete", 5, 0)
    ids = sorted(r["id"] for r in read_jsonl_dir(tmp_path / "out" / "shards"))
    assert ids == [f"r{i:04d}" for i in range(5)]


def _dataset_snapshot(tmp_path: Path, data_suffix: str) -> Path:
    """A dataset folder as the Hugging Face hub gives it: data files beside a README.md and a
    LICENSE (and a notebook below)."""
    data = tmp_path / "dataset"
    write_jsonl(data / "data" / f"train{data_suffix}", chat_rows(3))
    (data / "README.md").write_text("---\nlicense: mit\n---\n# A dataset\n\nRows of chats.\n")
    (data / "LICENSE").write_text("MIT License\n\nCopyright ...\n")
    (data / "notebooks").mkdir()
    (data / "notebooks" / "explore.ipynb").write_text('{"cells": []}\n')
    return data


@pytest.mark.parametrize("fmt", ["auto", "jsonl"])
def test_a_dataset_folders_documents_are_left_out_with_a_warning(
    tiny_model: Path, tmp_path: Path, fmt: str, caplog: pytest.LogCaptureFixture
) -> None:
    """They were refused (auto: "cannot tell the format of README.md") or read as rows
    (jsonl: the README's lines became error rows)."""
    spec = job_dict(tiny_model, _dataset_snapshot(tmp_path, ".jsonl"), tmp_path / "out")
    spec["input"]["format"] = fmt
    with caplog.at_level("WARNING", logger="tokenmill.io.readers.file_listing"):
        report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_ok, report.rows_failed) == ("complete", 3, 0)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "left out 3 file(s)" in warned and "README.md" in warned, warned


@pytest.mark.parametrize("name", ["train.jsonl.lz4", "train.zip"])
def test_an_archive_not_read_is_refused_by_name_whatever_the_format(
    tiny_model: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """With input.format set its bytes were read as rows: every line an error row, exit 0."""
    data = tmp_path / "data"
    data.mkdir()
    (data / name).write_bytes(b"\x04\x22\x4d\x18 not text\n\x00\x01\x02\n")
    spec = job_dict(tiny_model, data, tmp_path / "out")
    spec["input"]["format"] = "jsonl"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    assert cli_main([str(job)]) == 2
    err = capsys.readouterr().err
    assert name in err and "not read" in err, err
