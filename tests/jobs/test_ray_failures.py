"""Ray replicas that fail whatever they run, on CPU with 2 replicas: a replica SIGKILLed at
a random moment costs nothing (exit 0, every row once, the same output as an uninterrupted
run), and neither does an outage of every replica's engine nor a replica whose start hangs.

Rows that fail every replica that runs them are tests/jobs/test_ray_poison_rows.py's (split
from this module so that two pytest-xdist workers run the two at once). Both run on
``poisoned_ray`` (tests/jobs/conftest.py): a Ray of the module's own whose workers run
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
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import ray_poison
from tests.jobs.job_helpers import (
    chat_rows,
    committed_shards,
    job_dict,
    read_jsonl_dir,
    run_cli,
    write_job,
    write_jsonl,
)
from tests.jobs.ray_failure_helpers import RAY, SMALL, rows_by_id
from tokenmill import run_job

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.usefixtures("poisoned_ray")

SHARDS = 12  # the kill test's 48 rows, 4 a shard
# The kill test's rows are longer: on a loaded 2-core machine (CI, the suite in two workers)
# 16-token rows could all be answered before the first shard was committed, leaving the
# killer no stepping replica to kill (seen once, 2026-12-03).
LONG_ROWS = {**SMALL, "sampling": {"max_tokens": 40}}


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
        assert run_cli(write_job(tmp_path, spec), "--quiet") == 0, f"seed {seed}"
    killer.join(5)

    assert killer.killed_pid is not None and 0 < killer.shards_at_kill < SHARDS, f"seed {seed}"
    assert any("Ray replica" in r.message and "failed" in r.message for r in caplog.records)
    assert rows_by_id(out, "shards") == rows_by_id(tmp_path / "local", "shards"), f"seed {seed}"
    assert read_jsonl_dir(out / "errors") == []
    failures = json.loads((out / "report.json").read_text())["replica_failures"]
    assert failures["replicas"] >= 1 and failures["rows_rerun"] >= 1, failures
    assert failures["rows_isolated"] == 0
    assert "Ray replica failures" in (out / "report.html").read_text()


def _through_an_outage(
    tiny_model: Path, tmp_path: Path, rows: int, failures: int, breaker: int | None = None
) -> dict:
    """Run a job of ``rows`` on Ray while every replica's engine fails ``failures`` times
    (an outage: tests/jobs/ray_poison.py), with ``execution.replica_failures_in_a_row:
    breaker``, check it wrote every row as the local run does and no error row, and return
    its report's ``replica_failures``."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(rows))
    assert run_job(job_dict(tiny_model, src, tmp_path / "local", **SMALL), show_progress=False)
    outage = ray_poison.outage_dir()
    shutil.rmtree(outage, ignore_errors=True)
    outage.mkdir()
    for i in range(failures):
        (outage / f"failure-{i}").touch()
    try:
        out = tmp_path / "ray"
        execution = {**RAY, "replica_failures_in_a_row": breaker}
        spec = job_dict(tiny_model, src, out, execution=execution, **SMALL)
        assert run_cli(write_job(tmp_path, spec), "--quiet") == 0
        assert list(outage.iterdir()) == []  # the whole outage happened
    finally:
        shutil.rmtree(outage, ignore_errors=True)
    assert read_jsonl_dir(out / "errors") == []
    assert rows_by_id(out, "shards") == rows_by_id(tmp_path / "local", "shards")
    return json.loads((out / "report.json").read_text())["replica_failures"]


def test_an_outage_shorter_than_the_breaker_costs_no_row(tiny_model: Path, tmp_path: Path) -> None:
    """Every replica's engine failing whatever it runs, 8 times (an engine or cluster
    outage, one failure fewer than the breaker, set to 9): the chunks were bisected down to
    single rows, and good rows were skipped as poison rows. A row failing alone while no
    chunk finishes now waits for one; every row is written, no error row, and the breaker
    does not trip one failure early.

    8, not more: each failure is a replica restart (a new Ray worker importing torch, ~5 s
    on 2 cores), the suite's costliest step. Not fewer either: 8 still takes the chunks
    down to rows failing alone: the executor before 0762287 wrote 3 of the 16 good rows as
    error rows here (7 with 12 failures); a shorter outage ends before any row has failed
    the 3 times, alone at the last, that a poison row takes."""
    failures = _through_an_outage(tiny_model, tmp_path, rows=16, failures=8, breaker=9)
    assert failures["replicas"] == 8 and failures["rows_isolated"] == 0, failures


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
    ray_poison.hang_start_flag().touch()
    try:
        out = tmp_path / "ray"
        report = run_job(job_dict(tiny_model, src, out, execution=RAY, **SMALL),
                         show_progress=False)  # fmt: skip
    finally:
        ray_poison.hang_start_flag().unlink()
    assert report.status == "complete" and report.rows_ok == 8
    assert rows_by_id(out, "shards") == rows_by_id(tmp_path / "local", "shards")
