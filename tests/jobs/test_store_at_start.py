"""A store that fails at the start of a run: out of reach is temporary (exit 75, a rerun gets
past it once the store is back), a missing bucket or a refused prefix is not (exit 2); both
name the path. A second stop signal while the start talks to the store stops the run
(exit 75), never reads as the store's fault."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest

from tests.jobs.job_helpers import chat_rows, job_dict, run_cli, write_job, write_jsonl
from tests.s3_server import s3_endpoint  # noqa: F401
from tokenmill.jobs import preflight
from tokenmill.jobs.stop_signals import JobInterrupted


def _closed_endpoint() -> str:
    """An address where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _job(tmp_path: Path, model: Path, input_path: str, output_path: str, options: dict) -> Path:
    spec = job_dict(model, input_path, output_path)
    spec["input"]["storage_options"] = dict(options) if input_path.startswith("s3") else {}
    spec["output"]["storage_options"] = dict(options) if output_path.startswith("s3") else {}
    return write_job(tmp_path, spec)


@pytest.mark.parametrize("down", ["input", "output"])
def test_a_store_out_of_reach_at_the_start_exits_75_naming_the_path(
    tiny_model: Path, tmp_path: Path, capsys, down: str
) -> None:
    options = {"key": "k", "secret": "s", "endpoint_url": _closed_endpoint()}
    options["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 1}
    local_in = str(write_jsonl(tmp_path / "in.jsonl", chat_rows(3)))
    input_path = "s3://bkt/in/p.jsonl" if down == "input" else local_in
    output_path = "s3://bkt/out" if down == "output" else str(tmp_path / "out")
    job = _job(tmp_path, tiny_model, input_path, output_path, options)
    assert run_cli(job, "--quiet") == 75
    err = capsys.readouterr().err
    where = input_path if down == "input" else output_path
    assert f"{down}.path '{where}' cannot be reached" in err
    assert "rerun once the store is reachable" in err and "secret" not in err


def test_a_missing_output_bucket_exits_2_naming_the_output(
    tiny_model: Path,
    tmp_path: Path,
    capsys,
    s3_endpoint,  # noqa: F811
) -> None:
    _, options = s3_endpoint
    local_in = str(write_jsonl(tmp_path / "in.jsonl", chat_rows(3)))
    output = f"s3://no-bucket-{uuid.uuid4().hex[:8]}/out"
    assert run_cli(_job(tmp_path, tiny_model, local_in, output, options), "--quiet") == 2
    err = capsys.readouterr().err
    assert f"{output}: writing _tokenmill_owner.json failed" in err, err


def test_a_stop_while_the_start_reads_the_input_stops_the_run(
    tiny_model: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    def interrupted(cfg):
        raise JobInterrupted("SIGTERM received again: stopping now")

    monkeypatch.setattr(preflight, "list_input_files", interrupted)
    local_in = str(write_jsonl(tmp_path / "in.jsonl", chat_rows(3)))
    job = _job(tmp_path, tiny_model, local_in, str(tmp_path / "out"), {})
    assert run_cli(job, "--quiet") == 75
    err = capsys.readouterr().err
    assert "stopped (SIGTERM received again" in err and "cannot be read" not in err
