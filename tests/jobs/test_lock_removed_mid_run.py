"""A run whose lock file is removed while it runs (a person's ``rm``, a cleanup script's)
stops before its next commit: a second run could lock a new file at the path and write the
same output, and both committed shards and manifests over each other (lock.py)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest

from tests.jobs.job_helpers import chat_rows, job_dict, read_jsonl_dir, write_jsonl
from tests.s3_server import s3_endpoint  # noqa: F401
from tokenmill import run_job
from tokenmill.io.storage import OutputStore
from tokenmill.jobs import shard_writer
from tokenmill.jobs.lock import JobLock, JobLockedError, LockLostError
from tokenmill.jobs.report import JobReport
from tokenmill.jobs.runner import open_output
from tokenmill.jobs.spec import coerce_spec

ROWS = 12


def _spec(tiny_model: Path, tmp_path: Path, where: str, request: pytest.FixtureRequest) -> dict:
    """A job of ROWS rows, two a shard, writing a local folder or an S3 prefix."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(ROWS))
    if where == "local":
        return job_dict(tiny_model, src, tmp_path / "out", output={"rows_per_shard": 2})
    _, options = request.getfixturevalue("s3_endpoint")
    fsspec.filesystem("s3", **options).mkdir("jobs")
    spec = job_dict(tiny_model, src, "s3://jobs/out/", output={"rows_per_shard": 2})
    spec["output"]["storage_options"] = options
    return spec


def _output_ids(spec: dict) -> list[str]:
    """The ids of the rows in the output's shards, sorted (a row twice appears twice)."""
    url, options = spec["output"]["path"], spec["output"].get("storage_options", {})
    if not url.startswith("s3://"):
        return sorted(r["id"] for r in read_jsonl_dir(Path(url) / "shards"))
    fs = fsspec.filesystem("s3", **options)
    fs.invalidate_cache()
    lines = [
        line for key in fs.glob(f"{url}shards/*.jsonl") for line in fs.cat_file(key).splitlines()
    ]
    return sorted(json.loads(line)["id"] for line in lines)


def _recording(real: Callable[..., Any], method: str, calls: list[str]) -> Callable[..., Any]:
    def spy(self: OutputStore, *args: Any, **kwargs: Any) -> Any:
        calls.append(f"{method} {args[0] if args else ''}")
        return real(self, *args, **kwargs)

    return spy


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_run_whose_lock_file_is_removed_commits_nothing_beside_the_next_run(
    tiny_model: Path,
    tmp_path: Path,
    where: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # an object-store output's lock's
    spec = _spec(tiny_model, tmp_path, where, request)
    lock_path = open_output(coerce_spec(spec))[1].path
    b_reports: list[JobReport] = []
    a_writes: list[str] = []  # what run A wrote or deleted once run B had the output

    def cleanup_then_run_b(_: object) -> None:  # A has its model, about to generate
        lock_path.unlink()  # a cleanup script's rm of A's live lock file
        b_reports.append(run_job(spec, show_progress=False))  # B gets in: a new lock file
        for method in ("write_atomic", "writing", "delete", "delete_many"):
            real = getattr(OutputStore, method)
            monkeypatch.setattr(OutputStore, method, _recording(real, method, a_writes))

    with pytest.raises(LockLostError, match="lost its lock") as lost:
        run_job(spec, show_progress=False, on_progress=cleanup_then_run_b)
    assert isinstance(lost.value, JobLockedError)  # run-job: exit 75, a rerun resumes
    assert b_reports[0].status == "complete" and b_reports[0].rows_this_run == ROWS
    assert a_writes == []  # no shard, record, manifest or report over B's
    monkeypatch.undo()

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    again = run_job(spec, show_progress=False)
    assert again.status == "complete" and again.rows_this_run == 0  # nothing to redo
    assert _output_ids(spec) == sorted(r["id"] for r in chat_rows(ROWS))  # each row once


def test_check_held_fails_once_the_file_at_the_path_is_not_the_one_locked(
    tmp_path: Path,
) -> None:
    out = str(tmp_path)
    with JobLock("a", out, out) as a:
        a.check_held()  # intact: nothing to say
        a.path.unlink()
        with pytest.raises(LockLostError, match=r"lost its lock.*was removed or replaced"):
            a.check_held()
        with JobLock("b", out, out) as b:  # the run that got in
            b.check_held()
            with pytest.raises(LockLostError):
                a.check_held()  # replaced, not only gone
            a.release()  # leaves b's file and lock as they are
            b.check_held()
            with pytest.raises(JobLockedError, match="being written by job 'b'"):
                JobLock("c", out, out).acquire()


@pytest.mark.parametrize("how", ["renamed", "deleted"])
def test_a_run_whose_output_folder_goes_mid_run_stops_as_lock_lost_and_the_rerun_completes(
    tiny_model: Path, tmp_path: Path, how: str
) -> None:
    """An audit: once the output folder was renamed or deleted mid-run, releasing the lock
    listed the folder that was no longer there, and that FileNotFoundError replaced the run's
    own LockLostError (run-job: exit 2, "rerunning as it is does not help", when it does)."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(ROWS))
    out, moved = tmp_path / "out", tmp_path / "moved"
    spec = job_dict(tiny_model, src, out, output={"rows_per_shard": 2})

    def take_the_folder_away(_: object) -> None:  # the model loaded, nothing committed yet
        if how == "renamed" and out.exists():
            out.rename(moved)
        elif out.exists():
            shutil.rmtree(out)

    folder_went = rf"lost its lock, the output folder {re.escape(str(out))} was removed or renamed"
    with pytest.raises(LockLostError, match=folder_went):
        run_job(spec, show_progress=False, on_progress=take_the_folder_away)
    assert not out.exists()  # nothing written at the path once the folder went
    if how == "renamed":
        moved.rename(out)  # put back as it was: the rerun resumes it
    again = run_job(spec, show_progress=False)
    assert again.status == "complete"
    assert _output_ids(spec) == sorted(r["id"] for r in chat_rows(ROWS))  # each row once


def test_an_output_folder_removed_between_the_fence_and_a_shard_write_is_not_made_again(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit: ``rm -rf out/`` landing after a commit's lock check, before its shard's
    write. The write made the folder again, holding that shard alone; the run exited 75
    saying its lock file was removed, and every rerun, --fresh too, exited 2 refusing an
    output holding files "job 'test' did not write"."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(ROWS))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, output={"rows_per_shard": 2})
    commit = shard_writer.commit_shard

    def removed_before_shard_2(store: OutputStore, shard: int, *args: Any, **kwargs: Any) -> Any:
        if shard == 2 and out.exists():
            shutil.rmtree(out)
        return commit(store, shard, *args, **kwargs)

    monkeypatch.setattr(shard_writer, "commit_shard", removed_before_shard_2)
    folder_went = rf"lost its lock, the output folder {re.escape(str(out))} was removed"
    with pytest.raises(LockLostError, match=folder_went):
        run_job(spec, show_progress=False)
    monkeypatch.undo()
    assert not out.exists()  # nothing written at the path once the folder went
    again = run_job(spec, show_progress=False)
    assert again.status == "complete" and again.rows_this_run == ROWS
    assert _output_ids(spec) == sorted(r["id"] for r in chat_rows(ROWS))  # each row once
