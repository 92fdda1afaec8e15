"""A job reading from and writing to S3 (moto's server on 127.0.0.1), killed and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest
import yaml

from tests.jobs.job_helpers import (
    chat_rows,
    committed_shards,
    count_rows_read,
    job_dict,
    write_jsonl,
)
from tests.s3_server import s3_endpoint  # noqa: F401
from tokenmill import run_job
from tokenmill.jobs.spec import JobSpecError


def _committed_shards(fs) -> int:
    fs.invalidate_cache()
    return len(committed_shards("jobs/out", fs=fs))


def test_s3_job_killed_and_resumed(tiny_model: Path, tmp_path: Path, s3_endpoint) -> None:  # noqa: F811
    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("jobs")
    rows = chat_rows(40)
    for part in range(2):
        fs.pipe_file(
            f"jobs/in/part-{part}.jsonl",
            "".join(json.dumps(r) + "\n" for r in rows[part * 20 : (part + 1) * 20]).encode(),
        )
    spec = job_dict(
        tiny_model,
        "s3://jobs/in/",
        "s3://jobs/out/",
        sampling={"max_tokens": 10},
        engine={"max_num_seqs": 2},
    )
    spec["input"]["storage_options"] = options
    spec["output"]["storage_options"] = options
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))

    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.jobs.cli", str(job), "--quiet"],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        fs.invalidate_cache()
        if _committed_shards(fs) > 0:  # kill once the manifest names a shard
            break
        time.sleep(0.05)
    killed = proc.poll() is None
    if killed:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert killed, "the job finished before it could be killed"

    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_resumed > 0
    fs.invalidate_cache()
    out_rows = []
    for key in sorted(fs.glob("jobs/out/shards/*.jsonl")):
        out_rows.extend(json.loads(line) for line in fs.cat_file(key).decode().splitlines())
    assert sorted(r["id"] for r in out_rows) == sorted(r["id"] for r in rows)
    assert fs.exists("jobs/out/report.json") and fs.exists("jobs/out/test.manifest.json")


def test_an_existing_object_as_output_is_refused(
    tiny_model: Path,
    tmp_path: Path,
    s3_endpoint,  # noqa: F811
) -> None:
    """As a local output.path that is a file is refused: the shards would land under a key
    that is an object already (existing.csv/shards/...)."""
    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("held")
    fs.pipe("held/data/existing.csv", b"a,b\n")
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    spec = job_dict(tiny_model, src, "s3://held/data/existing.csv")
    spec["output"]["storage_options"] = options
    with pytest.raises(JobSpecError, match="is an existing object; output.path must be a prefix"):
        run_job(spec, show_progress=False)
    assert fs.find("held") == ["held/data/existing.csv"]


def test_s3_input_rows_sampled_for_the_shard_size_are_downloaded_once(
    tiny_model: Path,
    tmp_path: Path,
    s3_endpoint,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """output.rows_per_shard left out: the first rows, read to size the shards, are the
    run's own first rows (shard_size.py), not fetched from S3 a second time."""
    from tokenmill.jobs import shard_size

    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("jobs")
    rows = [{**row, "topic": "x" * 20_000} for row in chat_rows(12)]
    fs.pipe_file("jobs/in/rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    spec = job_dict(tiny_model, "s3://jobs/in/rows.jsonl", tmp_path / "out")
    del spec["output"]["rows_per_shard"]
    spec["input"]["storage_options"] = options
    monkeypatch.setattr(shard_size, "SHARD_BYTES", 64 << 10)  # 3 rows of 20 KB a shard

    made = count_rows_read(monkeypatch)
    assert run_job(spec, show_progress=False).rows_ok == len(rows)
    manifest = json.loads((tmp_path / "out" / "test.manifest.json").read_text())
    assert manifest["rows_per_shard"] == 3
    assert sorted(made) == list(range(len(rows)))
    assert max(made.values()) == 1, f"rows read twice: {[i for i, n in made.items() if n > 1]}"


def test_fresh_discards_a_job_s_files_in_batched_requests(
    s3_endpoint,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--fresh's ``discard_progress`` removes the job's shards, error files and journal in
    batched DeleteObjects requests, not one DeleteObject a file (2,400 shards took 10 s on
    a local S3 that way), and nothing of a sibling prefix (out2) or of another name."""
    import s3fs.core

    from tokenmill.io.storage import OutputStore
    from tokenmill.jobs.shard_commit import discard_progress

    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("jobs")
    job_files = [f"shards/part-{i:05d}.jsonl" for i in range(30)]
    job_files += [f"errors/part-{i:05d}.jsonl" for i in range(30)]
    job_files += [f"test.manifest.d/{i:08d}.json" for i in range(5)]
    job_files += ["test.manifest.json", "report.json"]
    for prefix in ("jobs/out", "jobs/out2"):
        fs.pipe({f"{prefix}/{name}": b"{}\n" for name in job_files})
    fs.pipe_file("jobs/out/notes.txt", b"mine")

    requests: list[str] = []
    call_s3 = s3fs.core.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        requests.append(method)
        return await call_s3(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", counting)
    discard_progress(OutputStore("s3://jobs/out", options, owner="test"), "test")
    monkeypatch.undo()

    fs.invalidate_cache()
    assert fs.find("jobs/out") == ["jobs/out/notes.txt"]
    assert sorted(fs.find("jobs/out2")) == sorted(f"jobs/out2/{n}" for n in job_files)
    assert requests.count("delete_objects") == 1
    # the reports and the manifest, one by one after the batch; no file of the batch
    assert requests.count("delete_object") <= 3, requests


def test_fresh_says_which_files_the_store_refused_to_delete(s3_endpoint) -> None:  # noqa: F811
    """S3's batched delete answers per key, and s3fs drops the refusals: a journal record
    --fresh left behind would be read back by the fresh run as its own progress. The
    files still there after the delete are named, and nothing is said to be discarded."""
    from tokenmill.io.storage import OutputStore, StorageError
    from tokenmill.jobs.shard_commit import discard_progress

    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("refusing")
    names = [f"shards/part-{i:05d}.jsonl" for i in range(4)] + ["test.manifest.d/00000001.json"]
    fs.pipe({f"refusing/out/{name}": b"{}\n" for name in names})
    store = OutputStore("s3://refusing/out", options, owner="test")
    rm = store.fs.rm
    store.fs.rm = lambda paths, *a, **k: rm(  # the store refuses the journal's key
        [p for p in paths if "manifest.d" not in p] if isinstance(paths, list) else paths, *a, **k
    )
    with pytest.raises(
        StorageError, match=r"could not delete 1 of the files of job 'test' \(.*00000001\.json"
    ):
        discard_progress(store, "test")
    fs.invalidate_cache()
    assert fs.find("refusing/out") == ["refusing/out/test.manifest.d/00000001.json"]
