"""SIGKILL a real `run-job` process at several points; reruns must finish with every row
exactly once and the same greedy text as an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.jobs.job_helpers import (
    chat_rows,
    committed_shards,
    job_dict,
    read_jsonl_dir,
    write_jsonl,
)
from tokenmill import run_job
from tokenmill.jobs.cli import main as cli_main

ROWS = 60


def _start(job: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tokenmill.jobs.cli", str(job), "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )


def _committed(out: Path, job: str) -> int:
    return len(committed_shards(out, job))


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            break
        time.sleep(0.005)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_sigkill_at_several_points_then_resume(tiny_model: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(ROWS))
    ref_out, out = tmp_path / "ref", tmp_path / "out"
    run_job(job_dict(tiny_model, src, ref_out, sampling={"max_tokens": 12}), show_progress=False)
    spec = job_dict(tiny_model, src, out, sampling={"max_tokens": 12}, engine={"max_num_seqs": 4})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))

    # 1: as soon as the manifest exists (before any shard); 2: right after the first shard
    # file appears (possibly before the manifest names it); 3: after two more commits.
    points = [
        lambda: (out / "test.manifest.json").exists(),
        lambda: any((out / "shards").glob("part-*")) if (out / "shards").exists() else False,
        lambda: _committed(out, "test") >= 6,
    ]
    kills = 0
    for ready in points:
        proc = _start(job)
        _kill_when(proc, ready)
        kills += proc.returncode == -signal.SIGKILL
    assert kills >= 2, "the job finished before it could be killed"

    # The final resume in this process: run-job's own entry point, without another start of
    # Python, torch and the model's imports (3 s); the kills above are what need processes.
    assert cli_main([str(job), "--quiet"]) == 0
    ok = read_jsonl_dir(out / "shards")
    errors = read_jsonl_dir(out / "errors")
    ref = read_jsonl_dir(ref_out / "shards")
    assert not errors
    assert sorted(r["id"] for r in ok) == sorted(r["id"] for r in ref)  # each row exactly once
    assert {r["id"]: r["text"] for r in ok} == {r["id"]: r["text"] for r in ref}
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
