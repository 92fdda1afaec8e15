"""output.rows_per_shard left out: a fresh job picks it from its first rows' size (shard_size.py)
and records it in the manifest; a resumed job keeps the manifest's; job.yaml's value wins."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.jobs.job_helpers import (
    chat_rows,
    committed_shards,
    count_rows_read,
    job_dict,
    read_jsonl_dir,
    write_jsonl,
)
from tokenmill import run_job
from tokenmill.io.readers import InputConfig
from tokenmill.jobs import shard_size
from tokenmill.jobs.cli import main as cli_main
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.peekable_input import PeekableInput
from tokenmill.jobs.preflight import input_config
from tokenmill.jobs.spec import coerce_spec

ROWS = 30
WIDE = "x" * 20_000  # a row's passthrough: 20 KB
SMALL_SHARD = 64 << 10  # SHARD_BYTES for the tests: 3 wide rows a shard


def _wide_rows(n: int) -> list[dict[str, Any]]:
    return [{**row, "topic": WIDE} for row in chat_rows(n)]


def _spec(model: Path, src: Path, out: Path, **output: Any) -> dict[str, Any]:
    spec = job_dict(model, src, out, engine={"max_num_seqs": 2})
    del spec["output"]["rows_per_shard"]
    spec["output"].update(output)
    return spec


def _manifest_rows_per_shard(out: Path) -> int:
    return json.loads((out / "test.manifest.json").read_text())["rows_per_shard"]


def test_a_normal_job_keeps_1000(tiny_model: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(5))
    report = run_job(_spec(tiny_model, src, tmp_path / "out"), show_progress=False)
    assert report.rows_ok == 5
    assert _manifest_rows_per_shard(tmp_path / "out") == 1000


def test_the_sample_picks_a_count_within_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def sampled(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
        src = write_jsonl(tmp_path / "in.jsonl", rows)
        cfg = input_config(coerce_spec(_spec(Path("m"), src, tmp_path / "out")))
        return _sampled(cfg)

    count, read, mean = sampled(_wide_rows(ROWS))
    assert (count, read) == (1000, ROWS) and 20_000 < mean < 21_000  # 3,200 would fit
    monkeypatch.setattr(shard_size, "SHARD_BYTES", 1 << 20)
    assert sampled(_wide_rows(ROWS))[:2] == (50, ROWS)  # 1 MiB of 20.9 KB rows
    monkeypatch.undo()
    assert sampled(chat_rows(1500))[:2] == (1000, 1000)  # at most 1000, sampled as many
    assert sampled([{**chat_rows(2)[0], "topic": "x" * (65 << 20)}, *chat_rows(2)])[:2] == (1, 1)
    assert sampled([])[0] == 1000


def test_wide_rows_get_small_shards_and_resume_after_sigkill(
    tiny_model: Path, tmp_path: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", _wide_rows(ROWS))
    out = tmp_path / "out"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_spec(tiny_model, src, out)))
    start = (
        "import sys; from tokenmill.jobs import shard_size; "
        f"shard_size.SHARD_BYTES = {SMALL_SHARD}; "
        "from tokenmill.jobs.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", start, str(job), "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if len(committed_shards(out)) >= 2:
            break
        time.sleep(0.005)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    _, stderr = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    assert _manifest_rows_per_shard(out) == 3  # 64 KiB of 20 KB rows

    # The rerun samples nothing: a new sample (64 MiB here) would say 1000, and the shards
    # committed hold 3 rows each.
    assert shard_size.SHARD_BYTES == 64 << 20
    assert cli_main([str(job), "--quiet"]) == 0
    rows = read_jsonl_dir(out / "shards")
    assert sorted(r["id"] for r in rows) == [r["id"] for r in chat_rows(ROWS)]
    assert all(r["topic"] == WIDE for r in rows)
    assert _manifest_rows_per_shard(out) == 3
    assert len(committed_shards(out)) == ROWS // 3
    assert dry_run(coerce_spec(yaml.safe_load(job.read_text()))).resumable is True


def test_an_explicit_value_wins(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shard_size, "SHARD_BYTES", SMALL_SHARD)
    src = write_jsonl(tmp_path / "in.jsonl", _wide_rows(8))
    spec = _spec(tiny_model, src, tmp_path / "out", rows_per_shard=5)
    assert coerce_spec(spec).to_dict()["output"]["rows_per_shard"] == 5
    run_job(spec, show_progress=False)
    assert _manifest_rows_per_shard(tmp_path / "out") == 5
    assert len(committed_shards(tmp_path / "out")) == 2


def test_a_job_begun_with_1000_for_every_job_resumes(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older version gave every job 1000 (and the fingerprint covered it): its job, run
    again now that the sample would pick 3, is the same job."""
    src = write_jsonl(tmp_path / "in.jsonl", _wide_rows(6))
    out = tmp_path / "out"
    spec = _spec(tiny_model, src, out)
    assert "rows_per_shard" not in coerce_spec(spec).to_dict()["output"]
    from tokenmill.jobs import runner

    with monkeypatch.context() as older:
        older.setattr(runner, "with_shard_size", lambda spec, cfg, manifest: spec)
        assert run_job(spec, show_progress=False).rows_ok == 6
    monkeypatch.setattr(shard_size, "SHARD_BYTES", SMALL_SHARD)
    assert dry_run(coerce_spec(spec)).resumable is True
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_this_run == 0
    assert _manifest_rows_per_shard(out) == 1000


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_the_sampled_rows_are_the_runs_own(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """The rows weighed to size the shards are the first rows the run processes: each
    input row is read (parsed into an InputRow) once in the whole run, not once for the
    sample and again for the engine. (Parquet: input and output, the rows read with the
    schema the job fixes. An input on S3: test_s3_job.py.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _wide_rows(ROWS)
    src = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        write_jsonl(src, rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), src)
    spec = _spec(tiny_model, src, tmp_path / "out", format=fmt)
    monkeypatch.setattr(shard_size, "SHARD_BYTES", SMALL_SHARD)
    expected = _sampled(input_config(coerce_spec(spec)))[0]
    assert expected == 3  # 64 KiB of 20 KB rows

    made = count_rows_read(monkeypatch)
    report = run_job(spec, show_progress=False)
    assert report.rows_ok == ROWS
    assert _manifest_rows_per_shard(tmp_path / "out") == expected
    assert len(committed_shards(tmp_path / "out")) == ROWS // expected
    assert sorted(made) == list(range(ROWS))
    assert max(made.values()) == 1, f"rows read twice: {[i for i, n in made.items() if n > 1]}"


def _sampled(cfg: InputConfig) -> tuple[int, int, int]:
    """(rows per shard, rows sampled, their mean bytes) from the first rows of ``cfg``'s
    input, read apart from any run."""
    source = PeekableInput(cfg, None)
    try:
        return shard_size.peeked_rows_per_shard(source)
    finally:
        source.close()
