"""A job writing to S3 through a fault-injecting proxy (tests/fault_proxy.py) in front of moto.

    transient 5xx on PUTs       ─► the client retries; the job completes
    the store out for 3 s       ─► the job completes, or exits 75 naming the storage error;
                                   a rerun completes
    the store down for good     ─► exit 75 naming the storage error, committed shards kept;
                                   a rerun after the fault clears completes
    input GETs failing for good ─► exit 75 naming the input object, no credentials shown;
                                   a rerun after the fault clears completes

Every finished output is compared with an uninterrupted local run: each row exactly once,
the same greedy text. Client timeouts are small (storage_options.config_kwargs) so that each
fault costs seconds. All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import yaml

from tests.fault_proxy import FaultyS3, faulty_s3  # noqa: F401
from tests.jobs.job_helpers import committed_shards, job_dict, reference_run, run_cli
from tests.s3_server import s3_endpoint  # noqa: F401
from tokenmill import run_job
from tokenmill.jobs.runner import open_output
from tokenmill.jobs.spec import JobSpec

ROWS = 32  # 8 shards of 4
SETTINGS: dict[str, Any] = {"sampling": {"max_tokens": 8}, "engine": {"max_num_seqs": 4}}
RESUME_HINT = "rerun the same command to resume"


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(input file, {id: text}) of an uninterrupted local run."""
    return reference_run(tiny_model, tmp_path_factory.mktemp("s3-faults-ref"), ROWS, **SETTINGS)


class _S3Job:
    """A job writing to its own bucket through the proxy; checks read moto directly."""

    def __init__(self, model: Path, src: Path, s3: FaultyS3, tmp: Path, **client: Any) -> None:
        # S3 outputs lock per URL, in ~/.cache/tokenmill/locks: a bucket of its own, never
        # shared with another test run; ``remove_lock_file`` cleans up after it.
        self.bucket = f"faults-{uuid.uuid4().hex[:12]}"
        self.direct = fsspec.filesystem("s3", **s3.direct)
        self.direct.mkdir(self.bucket)
        self.spec = job_dict(model, src, f"s3://{self.bucket}/out", **SETTINGS)
        self.spec["output"]["storage_options"] = s3.options(**client)
        self.job = tmp / "job.yaml"
        self.job.write_text(yaml.safe_dump(self.spec))

    def patient(self) -> None:
        """The job's client settings, for a rerun once the fault is cleared: timeouts of 10 s
        and 3 retries, not the 1 s and few the faults are timed for. A rerun on a loaded box
        (the suite beside a demo and helpers) met a 1 s connect timeout with no fault
        injected, and failed its resume (exit 75)."""
        for section in ("input", "output"):
            options = self.spec[section].get("storage_options")
            if options and "config_kwargs" in options:
                options["config_kwargs"] = {
                    "connect_timeout": 10.0,
                    "read_timeout": 10.0,
                    "retries": {"max_attempts": 3, "mode": "standard"},
                }
        self.job.write_text(yaml.safe_dump(self.spec))

    def remove_lock_file(self) -> None:
        _, lock = open_output(JobSpec.from_dict(self.spec))
        lock.path.unlink(missing_ok=True)

    def start(self) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "tokenmill.jobs.cli", str(self.job), "--quiet"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )

    def finish(self, proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
        """(exit code, stderr) of ``proc``; killed if it outlives ``timeout``."""
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
            pytest.fail(f"run-job did not end within {timeout} s: {stderr}")
        return proc.returncode, stderr

    def shards(self) -> dict[str, Any]:
        """The manifest's committed shards, as moto holds them now."""
        self.direct.invalidate_cache()
        return committed_shards(f"{self.bucket}/out", fs=self.direct)

    def wait_for_commit(self, proc: subprocess.Popen, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ended = proc.poll() is not None  # before the look: a commit just before exit counts
            if self.shards():
                return
            if ended:
                break
            time.sleep(0.02)
        pytest.fail(f"the job ended before its first commit (exit {proc.poll()})")

    def assert_rows(self, want: dict[str, str]) -> None:
        """Every row exactly once, with the reference's text; no error rows."""
        self.direct.invalidate_cache()
        rows, errors = [], []
        for key in sorted(self.direct.find(f"{self.bucket}/out/")):
            if key.endswith(".jsonl") and "/shards/" in key:
                rows.extend(json.loads(x) for x in self.direct.cat_file(key).decode().splitlines())
            elif key.endswith(".jsonl") and "/errors/" in key:
                errors.extend(self.direct.cat_file(key).decode().splitlines())
            assert ".tmp-" not in key
        assert not errors
        assert sorted(r["id"] for r in rows) == sorted(want)
        assert {r["id"]: r["text"] for r in rows} == want


@pytest.fixture
def s3_job(
    tiny_model: Path,
    tmp_path: Path,
    reference: tuple[Path, dict],
    faulty_s3: FaultyS3,  # noqa: F811
) -> Iterator[Callable[..., _S3Job]]:
    """Make the test's job (client settings as keywords, see FaultyS3.options)."""
    jobs: list[_S3Job] = []

    def make(**client: Any) -> _S3Job:
        jobs.append(_S3Job(tiny_model, reference[0], faulty_s3, tmp_path, **client))
        return jobs[-1]

    yield make
    for job in jobs:
        job.remove_lock_file()


def _assert_storage_exit(rc: int, stderr: str) -> None:
    """Exit 75 with the one-line storage message, not a crash with a traceback (botocore's
    EndpointConnectionError, no OSError, included: it once gave exit 1)."""
    assert rc == 75, stderr
    assert "run-job: storage error" in stderr and RESUME_HINT in stderr, stderr
    assert "Traceback" not in stderr, stderr


def test_transient_5xx_on_puts_job_completes(
    reference: tuple[Path, dict],
    faulty_s3: FaultyS3,  # noqa: F811
    s3_job: Callable[..., _S3Job],
) -> None:
    """The first PUT fails each way, then about 20% of them: 503 SlowDown, or 500
    InternalError after the write landed (the retry rewrites the same bytes). botocore
    retries each request up to 8 times: nine failures in a row are 0.2**9 unlikely."""
    _, want = reference
    job = s3_job(retries=8)
    proxy = faulty_s3.proxy
    proxy.fail(503, "SlowDown", count=1)
    proxy.fail(500, "InternalError", count=1, after_forward=True)
    proxy.fail(503, "SlowDown", fraction=0.1)
    proxy.fail(500, "InternalError", fraction=0.11, after_forward=True)
    report = run_job(job.spec, show_progress=False)
    assert proxy.stats["failed"] >= 1 and proxy.stats["failed_after_forward"] >= 1, proxy.stats
    assert report.status == "complete" and report.rows_ok == ROWS
    job.assert_rows(want)


@pytest.mark.parametrize("outage", ["hang", "refuse"])
def test_store_out_for_seconds_mid_run(
    reference: tuple[Path, dict],
    faulty_s3: FaultyS3,  # noqa: F811
    s3_job: Callable[..., _S3Job],
    outage: str,
) -> None:
    """The store hangs (every request held past the 1 s read timeout) or refuses connections
    for 3 s after the first commit, longer than botocore's one retry (backoff <= 1 s) takes;
    then it is back."""
    _, want = reference
    job = s3_job(timeout_s=1.0, retries=1)
    proxy = faulty_s3.proxy
    proc = job.start()
    job.wait_for_commit(proc)
    committed = job.shards()
    if outage == "hang":
        proxy.hang(seconds=60)
    else:
        proxy.pause()
    time.sleep(3)
    proxy.clear()
    proxy.resume()
    rc, stderr = job.finish(proc)
    assert len(committed) < ROWS // 4, "the job was done before the outage"
    assert outage == "refuse" or proxy.stats["hung"] > 0, "no request was held"
    if rc != 0:
        _assert_storage_exit(rc, stderr)
    assert committed.items() <= job.shards().items(), "a committed shard was lost"

    job.patient()
    report = run_job(job.spec, show_progress=False)
    assert report.status == "complete"
    job.assert_rows(want)


def test_store_down_for_good_exits_75_then_resumes(
    reference: tuple[Path, dict],
    faulty_s3: FaultyS3,  # noqa: F811
    s3_job: Callable[..., _S3Job],
) -> None:
    """After the first commit every request fails (500 InternalError, after botocore's
    retries) until the run gives up: exit 75, committed shards kept; once the store is back
    a rerun completes. (A store refusing connections for good: see the "refuse" case above.)"""
    _, want = reference
    job = s3_job(timeout_s=1.0, retries=1)
    # Armed in the proxy by the first commit's manifest record (shard 0's journal entry): a
    # test thread that waited for the commit and then added the fault lost the race on a
    # loaded machine (the job had committed all 8 shards by then).
    faulty_s3.proxy.fail(
        500, "InternalError", methods=None, armed_by="test.manifest.d/00000000.json"
    )
    proc = job.start()
    job.wait_for_commit(proc)
    committed = job.shards()
    _assert_storage_exit(*job.finish(proc))
    assert committed.items() <= job.shards().items(), "a committed shard was lost"
    assert len(job.shards()) < ROWS // 4

    faulty_s3.proxy.clear()
    job.patient()
    report = run_job(job.spec, show_progress=False)
    assert report.status == "complete" and report.rows_resumed > 0
    job.assert_rows(want)


# Credentials no message, log or report may show (moto takes any).
_KEY, _SECRET = "AKIAFAULTPROXYTEST01", "fault/proxy+SECRET-value"


# gzip only: a plain file's failed read already exited 75 (it now names the object too:
# tests/io/readers/test_s3_input_faults.py), and each case here costs ~25 s of retries.
@pytest.mark.parametrize("suffix", [".jsonl.gz"])
def test_input_reads_failing_for_good_exit_75_naming_the_object_then_resume(
    reference: tuple[Path, dict],
    faulty_s3: FaultyS3,  # noqa: F811
    s3_job: Callable[..., _S3Job],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    suffix: str,
) -> None:
    """The input is 4 objects on the store; once the run has saved its manifest (the first
    file's rows are read by then, to size the shards), every GET of an input object fails
    (503 SlowDown, after the client's retries). Exit 75 naming the object, the credentials
    shown nowhere; a rerun after the fault clears completes, each row once. A gzip input's
    failed read exited 2 as "truncated or corrupt", rerunning said not to help (an audit)."""
    src, want = reference
    job = s3_job(timeout_s=1.0, retries=0)  # (s3fs retries a SlowDown 5 times: ~2 s a read)
    lines = src.read_bytes().splitlines(keepends=True)
    for part in range(4):
        data = b"".join(lines[part * 8 : (part + 1) * 8])
        data = gzip.compress(data) if suffix.endswith(".gz") else data
        job.direct.pipe_file(f"{job.bucket}/in/part-{part}{suffix}", data)
    job.spec["output"]["storage_options"] |= {"key": _KEY, "secret": _SECRET}
    job.spec["input"]["path"] = f"s3://{job.bucket}/in/"
    job.spec["input"]["storage_options"] = job.spec["output"]["storage_options"]
    job.job.write_text(yaml.safe_dump(job.spec))
    faulty_s3.proxy.fail(
        503, "SlowDown", methods=("GET",), path_contains="/in/part-", armed_by="test.manifest.json"
    )

    rc = run_cli(job.job, "--quiet", timeout_s=120)
    stderr = capsys.readouterr().err
    _assert_storage_exit(rc, stderr)
    assert f"s3://{job.bucket}/in/part-" in stderr, stderr
    assert faulty_s3.proxy.stats["failed"] > 0, faulty_s3.proxy.stats
    report = job.direct.cat_file(f"{job.bucket}/out/report.json").decode()
    assert json.loads(report)["status"] == "failed"
    for shown in (stderr, report):
        assert _KEY not in shown and _SECRET not in shown

    faulty_s3.proxy.clear()
    job.patient()
    assert run_cli(job.job, "--quiet", timeout_s=120) == 0, capsys.readouterr().err
    job.assert_rows(want)
