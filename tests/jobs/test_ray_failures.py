"""Ray replicas that fail mid-job, on CPU with 2 replicas: a replica SIGKILLed at a random
moment costs nothing (exit 0, every row once, the same output as an uninterrupted run), and
rows that make their replica's engine raise or its process die are isolated into the error
file while every other row is written.

This module starts its own Ray (not the shared ``ray_session``): its workers run
``tests/jobs/ray_poison.py``'s setup hook, which makes the engine fail on marked prompts."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.jobs import ray_poison
from tests.jobs.job_helpers import (
    chat_rows,
    committed_shards,
    job_dict,
    read_jsonl_dir,
    write_jsonl,
)
from tests.jobs.ray_poison import HANG, HANG_START_FLAG, KILL, OUTAGE_DIR, RAISE
from tokenmill import run_job
from tokenmill.jobs.cli import main as cli_main

ray = pytest.importorskip("ray")

SMALL = {"engine": {"max_num_seqs": 2}, "sampling": {"max_tokens": 16}}
RAY = {"executor": "ray", "replicas": 2, "ray_address": None}
SHARDS = 12  # the kill test's 48 rows, 4 a shard
# The kill test's rows are longer: on a loaded 2-core machine (CI, the suite in two workers)
# 16-token rows could all be answered before the first shard was committed, leaving the
# killer no stepping replica to kill (seen once, 2026-12-03).
LONG_ROWS = {**SMALL, "sampling": {"max_tokens": 40}}


@pytest.fixture(scope="module", autouse=True)
def ray_with_poison_hook() -> Iterator[None]:
    if ray.is_initialized():
        ray.shutdown()
    # Ray's workers cannot import the tests: the hook travels by value
    ray.cloudpickle.register_pickle_by_value(ray_poison)
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"worker_process_setup_hook": ray_poison.install},
    )
    yield
    ray.shutdown()


def _run_cli(spec: dict[str, Any], folder: Path) -> int:
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    return cli_main([str(job), "--quiet"])


def _rows_by_id(out: Path, kind: str) -> dict[str, dict[str, Any]]:
    rows = read_jsonl_dir(out / kind)
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows), f"a row was written twice in {kind}"
    return by_id


def _shards_done(manifest: Path) -> int:
    return len(committed_shards(manifest.parent, manifest.name.removesuffix(".manifest.json")))


class _Killer(threading.Thread):
    """Once the job has committed its first shard, waits a random 0-0.1 s, then SIGKILLs a
    random replica of the job's among those whose engines are stepping (so holding rows: a
    replica killed while idle is found only when it is next sent rows, and when the job ends
    first, never), its pid from the replica itself."""

    def __init__(self, manifest: Path, rng: random.Random) -> None:
        super().__init__(daemon=True)
        self.manifest, self.rng = manifest, rng
        self.killed_pid: int | None = None
        self.shards_at_kill = -1

    def run(self) -> None:
        deadline = time.monotonic() + 300  # a loaded 2-core box starts Ray replicas slowly
        while _shards_done(self.manifest) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(self.rng.uniform(0.0, 0.1))
        while time.monotonic() < deadline and _shards_done(self.manifest) < SHARDS:
            busy = self._stepping()
            if busy:
                replica = self.rng.choice(busy)
                pid = ray.get(replica.ready.remote(), timeout=60).pid
                self.shards_at_kill = _shards_done(self.manifest)
                os.kill(pid, signal.SIGKILL)
                self.killed_pid = pid
                return

    def _stepping(self) -> list[Any]:
        """The job's replicas whose engine step count rose over 0.2 s (a replica still
        loading its model, which cannot answer within 10 s, counts as idle)."""
        names = sorted(n for n in ray.util.list_named_actors() if n.startswith("tokenmill-kill-"))
        replicas = [ray.get_actor(n) for n in names]
        before = [_steps(r) for r in replicas]
        time.sleep(0.2)
        after = [_steps(r) for r in replicas]
        rows = zip(replicas, before, after, strict=True)
        return [r for r, b, a in rows if b is not None and a is not None and a > b]


def _steps(replica: Any) -> int | None:
    try:
        return ray.get(replica.steps.remote(), timeout=10)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        return None  # loading its model, or gone


def test_a_replica_killed_mid_job_costs_no_row(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(48))
    local = job_dict(tiny_model, src, tmp_path / "local", **LONG_ROWS)
    assert run_job(local, show_progress=False).status == "complete"

    out = tmp_path / "ray"
    seed = random.randrange(1 << 30)
    killer = _Killer(out / "kill.manifest.json", random.Random(seed))
    killer.start()
    spec = job_dict(tiny_model, src, out, name="kill", execution=RAY, **LONG_ROWS)
    with caplog.at_level(logging.WARNING, logger="tokenmill.jobs"):
        assert _run_cli(spec, tmp_path) == 0, f"seed {seed}"
    killer.join(5)

    assert killer.killed_pid is not None and 0 < killer.shards_at_kill < SHARDS, f"seed {seed}"
    assert any("Ray replica" in r.message and "failed" in r.message for r in caplog.records)
    assert _rows_by_id(out, "shards") == _rows_by_id(tmp_path / "local", "shards"), f"seed {seed}"
    assert read_jsonl_dir(out / "errors") == []
    failures = json.loads((out / "report.json").read_text())["replica_failures"]
    assert failures["replicas"] >= 1 and failures["rows_rerun"] >= 1, failures
    assert failures["rows_isolated"] == 0
    assert "Ray replica failures" in (out / "report.html").read_text()


def test_poison_rows_are_isolated_and_every_other_row_is_written(
    tiny_model: Path, tmp_path: Path
) -> None:
    rows = chat_rows(20)
    rows[5]["messages"][0]["content"] += f" {RAISE}"
    rows[14]["messages"][0]["content"] += f" {KILL}"
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    # the driver's engine is not poisoned: the local run answers every row
    assert run_job(job_dict(tiny_model, src, tmp_path / "local", **SMALL), show_progress=False)
    expected = _rows_by_id(tmp_path / "local", "shards")

    out = tmp_path / "ray"
    assert _run_cli(job_dict(tiny_model, src, out, execution=RAY, **SMALL), tmp_path) == 0

    errors = _rows_by_id(out, "errors")
    assert sorted(errors) == ["r0005", "r0014"]
    for row_id, what in (("r0005", "engine raised RuntimeError"), ("r0014", "process (pid")):
        message = errors[row_id]["error"]
        assert "failed every engine replica that ran it" in message and what in message, message
    assert _rows_by_id(out, "shards") == {k: v for k, v in expected.items() if k not in errors}
    # each poison row: three failures of its lineage, the last alone, before it is skipped
    failures = json.loads((out / "report.json").read_text())["replica_failures"]
    assert failures["rows_isolated"] == 2 and failures["replicas"] >= 6, failures


def test_replicas_failing_whatever_they_run_end_the_job(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An audit: with every replica's engine failing, 12 rows "completed", exit 0, every row
    written as an error ("failed every engine replica that ran it"). Replicas failing 16
    times in a row with nothing finishing end the job, exit 1, as the local executor ends
    on its engine's first error; rows in flight are not written, a rerun runs them."""
    rows = chat_rows(12)
    for row in rows:
        row["messages"][0]["content"] += f" {RAISE}"
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "ray"
    assert _run_cli(job_dict(tiny_model, src, out, execution=RAY, **SMALL), tmp_path) == 1
    assert "failed 16 times in a row with no chunk of rows finishing" in capsys.readouterr().err
    assert len(read_jsonl_dir(out / "errors")) < 12 and read_jsonl_dir(out / "shards") == []
    assert json.loads((out / "report.json").read_text())["status"] == "failed"


def _through_an_outage(tiny_model: Path, tmp_path: Path, rows: int, failures: int) -> dict:
    """Run a job of ``rows`` on Ray while every replica's engine fails ``failures`` times
    (an outage: tests/jobs/ray_poison.py), check it wrote every row as the local run does
    and no error row, and return its report's ``replica_failures``."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(rows))
    assert run_job(job_dict(tiny_model, src, tmp_path / "local", **SMALL), show_progress=False)
    outage = Path(OUTAGE_DIR)
    shutil.rmtree(outage, ignore_errors=True)
    outage.mkdir()
    for i in range(failures):
        (outage / f"failure-{i}").touch()
    try:
        out = tmp_path / "ray"
        assert _run_cli(job_dict(tiny_model, src, out, execution=RAY, **SMALL), tmp_path) == 0
        assert list(outage.iterdir()) == []  # the whole outage happened
    finally:
        shutil.rmtree(outage, ignore_errors=True)
    assert read_jsonl_dir(out / "errors") == []
    assert _rows_by_id(out, "shards") == _rows_by_id(tmp_path / "local", "shards")
    return json.loads((out / "report.json").read_text())["replica_failures"]


def test_an_outage_shorter_than_the_breaker_costs_no_row(tiny_model: Path, tmp_path: Path) -> None:
    """Every replica's engine failing whatever it runs, 12 times (an engine or cluster
    outage, fewer failures than the breaker's 16): the chunks were bisected down to single
    rows, and good rows were skipped as poison rows. A row failing alone while no chunk
    finishes now waits for one; every row is written, no error row."""
    failures = _through_an_outage(tiny_model, tmp_path, rows=16, failures=12)
    assert failures["replicas"] == 12 and failures["rows_isolated"] == 0, failures


def test_an_outage_with_nothing_but_parked_rows_left_costs_no_row(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A one-row job (or a job's tail) in an outage: the row fails alone with no chunk
    finishing, so it is parked, and nothing else is left to show that the cluster works.
    It was released unproven, each failure counting: after 3 failures the good row was
    written as an error row ("failed every engine replica that ran it"). A probe (one
    known-good request through a real replica's engine) runs instead; the outage's failures
    count against no row, and the first probe to finish releases it."""
    failures = _through_an_outage(tiny_model, tmp_path, rows=1, failures=3)
    assert failures["replicas"] == 3 and failures["rows_isolated"] == 0, failures
    assert failures["probes"] >= 1, failures


def test_rows_waiting_on_a_replica_whose_start_hangs_go_to_one_that_is_up(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit: a replica whose start hung (SIGSTOPped while it loaded) held the rows
    routed to it before any replica was up; the job sat at "152 of 160 rows done" until
    stopped. Once its start is overdue they go to the replica that is up."""
    from tokenmill.jobs import ray_executor

    monkeypatch.setattr(ray_executor, "START_GRACE_S", 3.0)
    monkeypatch.setattr(ray_executor, "START_GRACE_FACTOR", 0.0)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(8))
    assert run_job(job_dict(tiny_model, src, tmp_path / "local", **SMALL), show_progress=False)
    Path(HANG_START_FLAG).touch()
    try:
        out = tmp_path / "ray"
        report = run_job(job_dict(tiny_model, src, out, execution=RAY, **SMALL),
                         show_progress=False)  # fmt: skip
    finally:
        Path(HANG_START_FLAG).unlink()
    assert report.status == "complete" and report.rows_ok == 8
    assert _rows_by_id(out, "shards") == _rows_by_id(tmp_path / "local", "shards")


def test_a_hung_engine_is_replaced_and_its_row_isolated(tiny_model: Path, tmp_path: Path) -> None:
    """An engine that stops stepping while it holds rows (the process alive, answering) is
    killed after execution.stall_timeout_s; the row that hangs every replica it runs on is
    isolated, every other row is written."""
    rows = chat_rows(10)
    rows[3]["messages"][0]["content"] += f" {HANG}"
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    assert run_job(job_dict(tiny_model, src, tmp_path / "local", **SMALL), show_progress=False)
    expected = _rows_by_id(tmp_path / "local", "shards")

    out = tmp_path / "ray"
    # 2 s: a busy 2-core CI machine can hold a healthy replica's process off its core for
    # a while; only the hung engine should stall (1 s saved ~3 s here, not worth a flake)
    execution = {**RAY, "stall_timeout_s": 2.0}
    started = time.monotonic()
    assert _run_cli(job_dict(tiny_model, src, out, execution=execution, **SMALL), tmp_path) == 0
    assert time.monotonic() - started < 120

    errors = _rows_by_id(out, "errors")
    assert sorted(errors) == ["r0003"]
    assert "took no step for" in errors["r0003"]["error"], errors["r0003"]["error"]
    assert _rows_by_id(out, "shards") == {k: v for k, v in expected.items() if k != "r0003"}
    failures = json.loads((out / "report.json").read_text())["replica_failures"]
    assert failures["rows_isolated"] == 1 and failures["replicas"] >= 3, failures
