"""A stopped run whose stderr went away (a closed terminal, ``run-job ... 2>&1 | head -1``, a
full disk under ``2>> log``) still exits 75: its "stopped" message raised BrokenPipeError,
which main took for a storage error whose own message raised again, and run-job exited 1."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pytest

from tokenmill.jobs import cli, runner
from tokenmill.jobs.report import JobReport


@contextmanager
def _stderr_gone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """sys.stderr a pipe whose reader went away (set inside the test: pytest's capture puts
    its own back after the fixtures), line-buffered as sys.stderr is."""
    read, write = os.pipe()
    os.close(read)
    gone = open(write, "w", buffering=1)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(sys, "stderr", gone)
            yield
    finally:
        with suppress(OSError):  # (its buffer may still hold a message for the gone reader)
            gone.close()


def _stopped_run(spec: Any, **kwargs: Any) -> JobReport:
    os.kill(os.getpid(), signal.SIGTERM)  # the stop comes while the job runs
    return JobReport(job="job", output="out", executor="local", status="cancelled")


def test_a_stopped_run_exits_75_when_stderr_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_spec", lambda args: None)
    monkeypatch.setattr(runner, "run_job", _stopped_run)
    with _stderr_gone(monkeypatch):
        code = cli.main(["job.yaml", "--quiet"])
    assert code == cli.EXIT_TEMPORARY


def test_a_failure_message_to_a_gone_stderr_keeps_its_exit_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _stderr_gone(monkeypatch):
        code = cli._fail("another run holds the output", cli.EXIT_TEMPORARY)
    assert code == cli.EXIT_TEMPORARY
