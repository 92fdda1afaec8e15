"""Rows that fail every Ray replica that runs them, on CPU with 2 replicas: rows that make
their replica's engine raise, its process die or its engine hang are isolated into the error
file while every other row is written, and a job whose every row fails ends.

Split from test_ray_failures.py (replicas that fail whatever they run) so that two
pytest-xdist workers run the two at once. Both run on ``poisoned_ray`` (tests/jobs/conftest.py):
a Ray of the module's own whose workers run ``tests/jobs/ray_poison.py``'s setup hook, which
makes the engine fail on marked prompts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.jobs.job_helpers import (
    chat_rows,
    job_dict,
    read_jsonl_dir,
    run_cli,
    write_job,
    write_jsonl,
)
from tests.jobs.ray_failure_helpers import RAY, SMALL, rows_by_id
from tests.jobs.ray_poison import HANG, KILL, RAISE
from tokenmill import run_job

pytest.importorskip("ray")
pytestmark = pytest.mark.usefixtures("poisoned_ray")


def test_poison_rows_are_isolated_and_every_other_row_is_written(
    tiny_model: Path, tmp_path: Path
) -> None:
    rows = chat_rows(20)
    rows[5]["messages"][0]["content"] += f" {RAISE}"
    rows[14]["messages"][0]["content"] += f" {KILL}"
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    # the driver's engine is not poisoned: the local run answers every row
    assert run_job(job_dict(tiny_model, src, tmp_path / "local", **SMALL), show_progress=False)
    expected = rows_by_id(tmp_path / "local", "shards")

    out = tmp_path / "ray"
    spec = job_dict(tiny_model, src, out, execution=RAY, **SMALL)
    assert run_cli(write_job(tmp_path, spec), "--quiet") == 0

    errors = rows_by_id(out, "errors")
    assert sorted(errors) == ["r0005", "r0014"]
    for row_id, what in (("r0005", "engine raised RuntimeError"), ("r0014", "process (pid")):
        message = errors[row_id]["error"]
        assert "failed every engine replica that ran it" in message and what in message, message
    assert rows_by_id(out, "shards") == {k: v for k, v in expected.items() if k not in errors}
    # each poison row: three failures of its lineage, the last alone, before it is skipped
    failures = json.loads((out / "report.json").read_text())["replica_failures"]
    assert failures["rows_isolated"] == 2 and failures["replicas"] >= 6, failures


def test_a_hung_engine_is_replaced_and_its_row_isolated(tiny_model: Path, tmp_path: Path) -> None:
    """An engine that stops stepping while it holds rows (the process alive, answering) is
    killed after execution.stall_timeout_s; the row that hangs every replica it runs on is
    isolated, every other row is written."""
    rows = chat_rows(10)
    rows[3]["messages"][0]["content"] += f" {HANG}"
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    assert run_job(job_dict(tiny_model, src, tmp_path / "local", **SMALL), show_progress=False)
    expected = rows_by_id(tmp_path / "local", "shards")

    out = tmp_path / "ray"
    # 2 s: a busy 2-core CI machine can hold a healthy replica's process off its core for
    # a while; only the hung engine should stall (1 s saved ~3 s here, not worth a flake)
    execution = {**RAY, "stall_timeout_s": 2.0}
    started = time.monotonic()
    spec = job_dict(tiny_model, src, out, execution=execution, **SMALL)
    assert run_cli(write_job(tmp_path, spec), "--quiet") == 0
    assert time.monotonic() - started < 120

    errors = rows_by_id(out, "errors")
    assert sorted(errors) == ["r0003"]
    assert "took no step for" in errors["r0003"]["error"], errors["r0003"]["error"]
    assert rows_by_id(out, "shards") == {k: v for k, v in expected.items() if k != "r0003"}
    failures = json.loads((out / "report.json").read_text())["replica_failures"]
    assert failures["rows_isolated"] == 1 and failures["replicas"] >= 3, failures


def test_replicas_failing_whatever_they_run_end_the_job(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An audit: with every replica's engine failing, 12 rows "completed", exit 0, every row
    written as an error ("failed every engine replica that ran it"). Replicas failing
    ``execution.replica_failures_in_a_row`` times in a row with nothing finishing end the
    job, exit 1, as the local executor ends on its engine's first error; rows in flight are
    not written, a rerun runs them.

    A breaker of 4, not the default 16: each failure is a replica restart (a new Ray worker
    importing torch, ~5 s on 2 cores). The failure count in the message is the breaker's
    own, so a breaker one off either way fails here."""
    rows = chat_rows(12)
    for row in rows:
        row["messages"][0]["content"] += f" {RAISE}"
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "ray"
    execution = {**RAY, "replica_failures_in_a_row": 4}
    spec = job_dict(tiny_model, src, out, execution=execution, **SMALL)
    assert run_cli(write_job(tmp_path, spec), "--quiet") == 1
    assert "failed 4 times in a row with no chunk of rows finishing" in capsys.readouterr().err
    assert len(read_jsonl_dir(out / "errors")) < 12 and read_jsonl_dir(out / "shards") == []
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed" and report["replica_failures"]["replicas"] == 4, report
