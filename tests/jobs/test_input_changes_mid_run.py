"""An input rewritten while a run reads it: the run does not call the job complete (it did,
exit 0, its output holding rows of the old content and of the new)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.jobs.job_helpers import chat_rows, job_dict, write_jsonl
from tokenmill import run_job
from tokenmill.jobs import runner
from tokenmill.jobs.cli import main as cli_main
from tokenmill.jobs.manifest import FingerprintMismatchError, InputChangedError


def _rewrite_after_load(monkeypatch: pytest.MonkeyPatch, src: Path, rows: list[Any]) -> None:
    """The input file is rewritten once the model has loaded, before any row is read (an
    upstream job writing it again)."""
    load = runner._count_and_load

    def load_then_rewrite(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        write_jsonl(src, rows)
        monkeypatch.setattr(runner, "_count_and_load", load)  # once
        return loaded

    monkeypatch.setattr(runner, "_count_and_load", load_then_rewrite)


def test_a_rewritten_input_leaves_the_job_incomplete_until_fresh(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    spec = job_dict(tiny_model, src, tmp_path / "out")
    _rewrite_after_load(monkeypatch, src, chat_rows(9, start=100))
    with pytest.raises(InputChangedError, match="changed while this run read it") as info:
        run_job(spec, show_progress=False)
    assert f"(input files changed: {src})" in str(info.value)  # which file
    manifest = json.loads((tmp_path / "out" / "test.manifest.json").read_text())
    assert not manifest.get("complete")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "failed" and "changed while this run" in report["error"]
    assert (report["rows_ok"], report["rows_this_run"]) == (9, 9)  # what it committed
    with pytest.raises(FingerprintMismatchError, match="input"):  # the input it read: refused
        run_job(spec, show_progress=False)
    report = run_job(spec, fresh=True, show_progress=False)
    assert (report.status, report.rows_ok) == ("complete", 9)


def test_the_command_exits_2(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    _rewrite_after_load(monkeypatch, src, chat_rows(7))  # one row appended
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tiny_model, src, tmp_path / "out")))
    assert cli_main([str(job), "--quiet"]) == 2
    assert "--fresh" in capsys.readouterr().err
