"""The job path beside the engine, end to end on the tiny model: a reader thread and a writer
thread give byte-identical shards to a run with the threads effectively serialized (queues
of one); their errors end the run with the exit codes and messages of a serial run, without
hanging; the engine's batch stays full across shard boundaries, with a bounded queue."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.jobs.job_helpers import (
    chat_rows,
    committed_shards,
    job_dict,
    read_jsonl_dir,
    run_cli,
    write_job,
    write_jsonl,
)
from tokenmill import run_job
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.io.readers import InputConfig, iter_input_rows
from tokenmill.io.readers.compression import CorruptInputError
from tokenmill.jobs import peekable_input, runner, shard_writer
from tokenmill.jobs.pipeline_bounds import PipelineBounds
from tokenmill.jobs.shard_commit import commit_shard
from tokenmill.jobs.spec import JobSpec

RESUME = "committed rows are kept; rerun the same command to resume"  # (how many: rows_kept.py)
BAD_LINES = [
    "{not json",
    json.dumps({"id": "too-long", "messages": [{"role": "user", "content": "x" * 2000}]}),
    json.dumps({"id": "r0003", "messages": [{"role": "user", "content": "duplicate"}]}),
]


def _input(folder: Path, rows: int = 30) -> Path:
    lines = [json.dumps(r) for r in chat_rows(rows)]
    for at, bad in zip((2, 13, 21), BAD_LINES, strict=True):
        lines.insert(at, bad)
    return write_jsonl(folder / "in.jsonl", lines)


def _files(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for folder in ("shards", "errors")
        for p in sorted((out / folder).iterdir())
    }


def _serialized(monkeypatch: pytest.MonkeyPatch) -> None:
    serial = PipelineBounds(batch_rows=1, read_ahead_rows=1, queued_shards=1)
    monkeypatch.setattr(runner, "pipeline_bounds", lambda spec: serial)


@pytest.mark.parametrize(
    ("fmt", "stop"), [("parquet", []), ("jsonl", ["e"])], ids=["parquet", "jsonl-stop-strings"]
)
def test_shards_are_byte_identical_to_a_serialized_run(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, stop: list[str]
) -> None:
    src = _input(tmp_path)
    output = {"format": fmt, "rows_per_shard": 4}
    engine = {"max_num_seqs": 3}
    sampling = {"max_tokens": 6, "stop": stop}
    outs = {}
    for mode in ("threads", "serial"):
        if mode == "serial":
            _serialized(monkeypatch)
        out = tmp_path / mode
        spec = job_dict(tiny_model, src, out, output=output, engine=engine, sampling=sampling)
        report = run_job(spec, show_progress=False)
        assert report.status == "complete" and (report.rows_ok, report.rows_failed) == (30, 3)
        outs[mode] = out
    assert _files(outs["threads"]) == _files(outs["serial"])
    manifests = [json.loads((outs[m] / "test.manifest.json").read_text()) for m in outs]
    assert manifests[0]["shards"] == manifests[1]["shards"]


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (
            OSError("connection reset by peer"),
            75,
            "storage error: OSError: connection reset by peer",
        ),
        (ValueError("line 23 vanished"), 1, "the job failed (ValueError: line 23 vanished)"),
        (
            CorruptInputError("in.jsonl.gz: gzip decompression failed"),
            2,
            "CorruptInputError: in.jsonl.gz: gzip decompression failed",
        ),
        (
            FileNotFoundError(2, "No such file or directory", "in/b.jsonl"),
            2,
            "FileNotFoundError: [Errno 2] No such file or directory: 'in/b.jsonl'",
        ),
    ],
    ids=["storage", "bug", "corrupt-input", "missing-file"],
)
@pytest.mark.parametrize("sized", [True, False], ids=["rows_per_shard", "sampled"])
def test_a_reader_error_ends_the_run_as_a_serial_run_would(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: Exception,
    code: int,
    message: str,
    sized: bool,
) -> None:
    """Also where the error comes among the rows a job with output.rows_per_shard left out
    sizes its shards from (the first 1,000 here): the run gets to them, not a refusal."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(40))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, engine={"max_num_seqs": 2})
    if not sized:
        del spec["output"]["rows_per_shard"]  # (1,000: no shard commits before the error)

    def failing(cfg: InputConfig, schema: Any = None) -> Iterator[Any]:
        for row in iter_input_rows(cfg, schema):
            if row.row_index == 22:
                raise error
            yield row

    monkeypatch.setattr(peekable_input, "iter_input_rows", failing)
    monkeypatch.setattr(runner, "pipeline_bounds", lambda s: PipelineBounds(4, 8, 1))
    assert run_cli(write_job(tmp_path, spec), "--quiet", timeout_s=120) == code
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"run-job: {message}; ")
    # a file to fix: rerunning as it is does not help (exit 2, and it says so)
    assert last.endswith("(rerunning as it is does not help)") is (code == 2)
    assert json.loads((out / "report.json").read_text())["status"] == "failed"
    committed = committed_shards(out)
    assert set(committed) <= {"0", "1", "2", "3", "4"}  # rows before 22 only
    # what it says is kept is what is (1,000 rows a shard: nothing)
    kept = f"the {4 * len(committed)} {RESUME}" if committed else "nothing was committed yet"
    assert kept in last, last

    monkeypatch.undo()
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_ok == 40
    assert report.rows_resumed == 4 * len(committed)
    assert sorted(r["id"] for r in read_jsonl_dir(out / "shards")) == [
        r["id"] for r in chat_rows(40)
    ]


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (OSError(28, "No space left on device"), 75, "storage error: OSError: [Errno 28]"),
        (RuntimeError("encoder bug"), 1, "the job failed (RuntimeError: encoder bug)"),
    ],
    ids=["storage", "bug"],
)
def test_a_writer_error_ends_the_run_as_a_serial_run_would(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: Exception,
    code: int,
    message: str,
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(24))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, engine={"max_num_seqs": 2})
    calls = []

    def failing(*args: Any) -> Any:
        calls.append(args[1])
        if len(calls) == 3:
            raise error
        return commit_shard(*args)

    monkeypatch.setattr(shard_writer, "commit_shard", failing)
    assert run_cli(write_job(tmp_path, spec), "--quiet", timeout_s=120) == code
    err = capsys.readouterr().err
    assert f"run-job: {message}" in err and err.strip().endswith(RESUME)
    assert len(calls) == 3  # nothing was committed after the failure
    committed = committed_shards(out)
    assert len(committed) == 2

    monkeypatch.undo()
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_ok == 24 and report.rows_resumed == 8


def test_the_engine_batch_stays_full_across_shard_boundaries(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until the last row is added, every step runs a full batch (max_num_seqs) and the
    engine never holds more than 2 * max_num_seqs requests."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(60))
    seqs = 3
    spec = job_dict(
        tiny_model,
        src,
        tmp_path / "out",
        engine={"max_num_seqs": seqs},
        sampling={"max_tokens": 5},
        output={"rows_per_shard": 2},
    )
    unfinished = 0
    added = 0
    before_step: list[tuple[int, int]] = []  # (rows added so far, requests in the engine)
    add, step = LLMEngine.add_request, LLMEngine.step

    def counting_add(self: LLMEngine, *args: Any) -> None:
        nonlocal unfinished, added
        add(self, *args)
        unfinished += 1
        added += 1

    def counting_step(self: LLMEngine) -> Any:
        nonlocal unfinished
        before_step.append((added, unfinished))
        outs = step(self)
        unfinished -= len(outs)
        return outs

    monkeypatch.setattr(LLMEngine, "add_request", counting_add)
    monkeypatch.setattr(LLMEngine, "step", counting_step)
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_ok == 60
    assert max(n for _, n in before_step) <= 2 * seqs
    while_input_left = [n for a, n in before_step if a < 60]
    assert len(while_input_left) > 10 and min(while_input_left) >= seqs


def test_bounds_follow_the_engine_and_refuse_nonsense() -> None:
    spec = JobSpec.from_dict(job_dict(Path("m"), "in.jsonl", "out", engine={"max_num_seqs": 512}))
    bounds = runner.pipeline_bounds(spec)
    assert (bounds.batch_rows, bounds.read_ahead_rows, bounds.queued_shards) == (64, 1024, 2)
    assert PipelineBounds.for_engine(1).read_ahead_rows == 256
    with pytest.raises(ValueError, match="PipelineBounds.queued_shards"):
        PipelineBounds(queued_shards=0)
