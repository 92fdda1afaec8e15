"""A Ray run whose cluster's head does not answer at start: run-job waited in ``ray.init``'s
own retries for minutes (a cron run hung there; an audit). It now waits LOST_AFTER_S for the
head, then exits 75 naming the address."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.jobs.job_helpers import chat_rows, job_dict, write_jsonl
from tokenmill.jobs import ray_cluster_watch
from tokenmill.jobs.ray_cluster_watch import ClusterLostError, wait_for_head

pytest.importorskip("ray")


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_head_that_does_not_answer_is_refused_naming_its_address() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    with pytest.raises(ClusterLostError, match=f"no Ray cluster answers at {address}"):
        wait_for_head(address, within_s=0.5)
    assert 0.5 <= time.monotonic() - start < 5


def test_a_head_that_answers_and_addresses_ray_resolves_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen()
        port = head.getsockname()[1]
        wait_for_head(f"127.0.0.1:{port}", within_s=0.5)
        wait_for_head(f"ray://127.0.0.1:{port}", within_s=0.5)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster_watch, "gcs_answers", lambda *a, **k: pytest.fail("probed"))
    for address in (None, "auto", "local"):
        wait_for_head(address, within_s=0.5)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # ray.init(None) joins RAY_ADDRESS
    with pytest.raises(pytest.fail.Exception, match="probed"):
        wait_for_head(None, within_s=0.5)


def test_run_job_exits_75_when_the_head_does_not_answer(tiny_model: Path, tmp_path: Path) -> None:
    address = f"127.0.0.1:{_closed_port()}"
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, execution={"executor": "ray", "ray_address": address})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    script = (
        "import sys\n"
        "from tokenmill.jobs import ray_cluster_watch\n"
        "ray_cluster_watch.LOST_AFTER_S = 1.0\n"
        "from tokenmill.jobs.cli import main\n"
        f"sys.exit(main([{str(job)!r}, '--quiet']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 75, proc.stderr
    assert f"no Ray cluster answers at {address}" in proc.stderr, proc.stderr
