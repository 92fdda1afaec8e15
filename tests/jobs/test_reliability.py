"""The ten findings of the 2026-12-01 hostile-user review (issue 11), one test or more each.

Each test failed on main before the fix: jobs overwriting each other, foreign files deleted,
output read back as input, gzip dropped, poison rows crashing every rerun, late errors,
YAML bombs, tracebacks instead of exit 2, repeated locations, and vanished shards trusted.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from safetensors.torch import load_file, save_file

from tests.jobs.job_helpers import (
    chat_rows,
    job_dict,
    read_jsonl_dir,
    run_cli,
    write_job,
    write_jsonl,
)
from tokenmill import run_job
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.fingerprint import (
    changed_settings,
    earlier_fingerprints,
    fingerprint,
    model_content,
    model_identity,
)
from tokenmill.jobs.lock import JobLock
from tokenmill.jobs.manifest import FingerprintMismatchError
from tokenmill.jobs.ownership import OWNER_FILE, OutputOwnedError
from tokenmill.jobs.spec import JobSpec, JobSpecError

INVALID, TEMPORARY = 2, 75


def _ids(folder: Path) -> list[str]:
    return sorted(r["id"] for r in read_jsonl_dir(folder))


# 1. Two jobs on one output.path ------------------------------------------------------------


@contextlib.contextmanager
def _manifest(out: Path) -> Iterator[dict]:
    """Job 'test''s manifest in ``out`` as a dict to edit; written back on leaving."""
    path = out / "test.manifest.json"
    manifest = json.loads(path.read_text())
    yield manifest
    path.write_text(json.dumps(manifest))


def test_second_job_on_an_output_is_refused_and_the_first_keeps_its_rows(
    tiny_model: Path, tmp_path: Path, capsys
) -> None:
    a_in = write_jsonl(tmp_path / "a.jsonl", chat_rows(6))
    b_in = write_jsonl(tmp_path / "b.jsonl", chat_rows(5, start=100))
    out = tmp_path / "out"
    assert run_job(job_dict(tiny_model, a_in, out, name="a"), show_progress=False).status == (
        "complete"
    )
    before = {p.name: p.read_bytes() for p in (out / "shards").iterdir()}

    with pytest.raises(OutputOwnedError, match="belongs to job 'a'"):
        run_job(job_dict(tiny_model, b_in, out, name="b"), show_progress=False)
    with pytest.raises(OutputOwnedError):  # --fresh discards only a job's own progress
        run_job(job_dict(tiny_model, b_in, out, name="b"), fresh=True, show_progress=False)
    assert run_cli(write_job(tmp_path, job_dict(tiny_model, b_in, out, name="b"))) == INVALID
    assert "belongs to job 'a'" in capsys.readouterr().err

    assert {p.name: p.read_bytes() for p in (out / "shards").iterdir()} == before
    again = run_job(job_dict(tiny_model, a_in, out, name="a"), show_progress=False)
    assert again.status == "complete" and again.rows_ok == 6
    assert _ids(out / "shards") == [r["id"] for r in chat_rows(6)]


def test_a_job_inside_another_jobs_output_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    """Job b written to a's shards/ folder put its manifest and reports among a's data files
    (pyarrow.dataset and polars then failed on a's output); both exited 0."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    out = tmp_path / "out"
    run_job(job_dict(tiny_model, src, out, name="a"), show_progress=False)
    before = sorted(p.name for p in (out / "shards").iterdir())
    for inner in (out / "shards", out / "x" / "y"):
        with pytest.raises(OutputOwnedError, match=f"output.path {inner} is inside the output "
                           f"of job 'a' \\({out} holds"):  # fmt: skip
            run_job(job_dict(tiny_model, src, inner, name="b"), show_progress=False)
    assert sorted(p.name for p in (out / "shards").iterdir()) == before
    assert not (out / "x").exists()
    # an output that was there first stays its job's when another job takes a folder above
    outer = tmp_path / "outer"
    assert run_job(job_dict(tiny_model, src, outer / "c", name="c"), show_progress=False).rows_ok
    assert run_job(job_dict(tiny_model, src, outer, name="d"), show_progress=False).rows_ok
    again = run_job(job_dict(tiny_model, src, outer / "c", name="c"), show_progress=False)
    assert again.status == "complete" and again.rows_resumed == 3


def test_job_blocked_by_another_jobs_running_run_is_refused_not_retried(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Run at the same time: the lock is the output's, so the second waits for nothing; a job
    that does not own the output gets exit 2 (not 75, which would invite a retry)."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    out = tmp_path / "out"
    run_job(job_dict(tiny_model, src, out, name="a"), show_progress=False)
    with JobLock("a", str(out), str(out)):  # job a is running
        assert run_cli(write_job(tmp_path, job_dict(tiny_model, src, out, name="b"))) == INVALID
        assert run_cli(write_job(tmp_path, job_dict(tiny_model, src, out, name="a"))) == TEMPORARY


def test_a_job_starting_beside_another_on_a_new_output_is_told_whose_it_becomes(
    tiny_model: Path, tmp_path: Path, capsys
) -> None:
    """Job a holds the lock of an output it has not claimed yet (its run just started): job
    b, started a moment later, is refused as another job's output (exit 2), not "retry
    later" (75), whose retry would be refused anyway; job a itself is told to retry."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    out = tmp_path / "out"
    out.mkdir()
    with JobLock("a", str(out), str(out)):  # a's run, before it wrote its owner record
        b = write_job(tmp_path, job_dict(tiny_model, src, out, name="b"))
        assert run_cli(b, "--quiet") == INVALID
        assert "is being claimed by job 'a', running now" in capsys.readouterr().err
        a = write_job(tmp_path, job_dict(tiny_model, src, out, name="a"))
        assert run_cli(a, "--quiet") == TEMPORARY


def test_unclaimed_output_with_files_at_our_names_is_refused(
    tiny_model: Path, tmp_path: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    out = tmp_path / "out"
    write_jsonl(out / "shards" / "part-00000.jsonl", [{"id": "someone else's"}])
    with pytest.raises(OutputOwnedError, match="did not write"):
        run_job(job_dict(tiny_model, src, out), show_progress=False)
    assert read_jsonl_dir(out / "shards") == [{"id": "someone else's"}]


def test_output_of_a_job_from_before_the_ownership_record_is_adopted(
    tiny_model: Path, tmp_path: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    out = tmp_path / "out"
    run_job(job_dict(tiny_model, src, out), show_progress=False)
    (out / OWNER_FILE).unlink()
    report = run_job(job_dict(tiny_model, src, out), show_progress=False)
    assert report.status == "complete" and report.rows_this_run == 0
    assert json.loads((out / OWNER_FILE).read_text())["job"] == "test"
    (out / OWNER_FILE).unlink()
    with pytest.raises(OutputOwnedError, match="belongs to job 'test'"):
        run_job(job_dict(tiny_model, src, out, name="other"), show_progress=False)


# 2. Files the job did not write are never deleted ------------------------------------------


def test_cleanup_and_fresh_delete_only_the_jobs_own_files(tiny_model: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(5))
    out = tmp_path / "out"
    run_job(job_dict(tiny_model, src, out), show_progress=False)
    foreign = [
        out / ".notes.txt.tmp-0123456789abcdef",  # a user's file in the temp pattern
        out / "shards" / ".data.tmp-fedcba9876543210",
        out / "shards" / "README.txt",
        out / "errors" / "triage.md",
        out / "mine.csv",
    ]
    for path in foreign:
        path.parent.mkdir(exist_ok=True)  # errors/: a job without bad rows writes none
        path.write_text("keep me")
    leftover = out / "shards" / f".part-00009.jsonl.tmp-{_token('test')}-0123456789abcdef"
    leftover.write_text("a killed writer's temp file")

    assert run_job(job_dict(tiny_model, src, out), show_progress=False).status == "complete"
    assert not leftover.exists()  # the job's own leftover goes
    changed = job_dict(tiny_model, src, out, sampling={"max_tokens": 4})
    assert run_job(changed, fresh=True, show_progress=False).status == "complete"
    assert all(p.read_text() == "keep me" for p in foreign)
    assert len(_ids(out / "shards")) == 5


def _token(job: str) -> str:
    from tokenmill.io.storage import owner_token

    return owner_token(job)


@pytest.mark.parametrize("path", ["/", "../..", "."])
def test_root_and_input_ancestors_are_refused(
    tiny_model: Path, tmp_path: Path, path: str, monkeypatch, capsys
) -> None:
    data = tmp_path / "work" / "data"
    src = write_jsonl(data / "in.jsonl", chat_rows(2))
    monkeypatch.chdir(data)  # "../.." and "." are then ancestors of the input
    job = write_job(tmp_path, job_dict(tiny_model, src, path))
    before = sorted(p for p in tmp_path.rglob("*"))
    assert run_cli(job, "--dry-run") == INVALID
    assert run_cli(job) == INVALID
    assert "output.path" in capsys.readouterr().err
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert not Path("/.tokenmill.lock").exists()


# 3. Output inside the input directory ------------------------------------------------------


@pytest.mark.parametrize(
    ("input_of", "output_of", "needle"),
    [
        (lambda d: d, lambda d: d / "out", "inside the input folder"),
        (lambda d: d / "**" / "*.jsonl", lambda d: d / "sub" / "out", "inside the input folder"),
        (lambda d: d / "*.jsonl", lambda d: d, "contains the input"),
        (lambda d: d / "*" / "*.json*", lambda d: d / "out", "inside the input folder"),
        (lambda d: d / "in.jsonl", lambda d: d / "in.jsonl", "the input file"),
        (lambda d: d / "in.jsonl", lambda d: d.parent, "contains the input"),
    ],
    ids=["dir", "recursive-glob", "glob-base", "glob-reaches-it", "the-file", "ancestor"],
)
def test_output_inside_or_over_the_input_is_refused(
    tiny_model: Path, tmp_path: Path, input_of, output_of, needle: str
) -> None:
    data = tmp_path / "data"
    write_jsonl(data / "in.jsonl", chat_rows(3))
    spec = job_dict(tiny_model, input_of(data), output_of(data))
    with pytest.raises(JobSpecError, match=needle):
        run_job(spec, show_progress=False)
    assert sorted(p.name for p in data.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize(
    ("pattern", "target", "output", "needle"),
    [
        ("in", "../other", "other/out", "is inside"),
        ("in/**", "../other", "other/out", "is inside"),
        ("in/*/*/*/*.jsonl", "../other", "other/out", "is inside"),  # (reaches its shards)
        ("in", "../other", "other", "is inside"),  # the link leads to the output itself
        ("in", "../out/shards", "out", "contains"),  # the input inside the output
    ],
    ids=["dir", "recursive-glob", "glob-reaches-it", "the-output", "output-over-it"],
)
def test_output_inside_or_over_a_linked_input_folder_is_refused(
    tiny_model: Path, tmp_path: Path, pattern: str, target: str, output: str, needle: str
) -> None:
    """in/more -> ../other, read by the listing as in/more/...: an output other/out was let
    through (the check compared real paths only), and its rerun read in/more/out's files as
    input ("cannot tell the format of .../more/out/.tokenmill.lock"; --fresh read them as rows)."""
    write_jsonl(tmp_path / "in" / "a.jsonl", chat_rows(3))
    (tmp_path / "other").mkdir()
    write_jsonl(tmp_path / "out" / "shards" / "part-00000.jsonl", chat_rows(2, start=3))
    (tmp_path / "in" / "more").symlink_to(target)
    before = sorted(tmp_path.rglob("*"))
    spec = job_dict(tiny_model, tmp_path / pattern, tmp_path / output)
    with pytest.raises(JobSpecError, match=needle) as refused:
        run_job(spec, show_progress=False)
    assert str(tmp_path / "in" / "more") in str(refused.value)  # names the link
    assert repr(str(tmp_path / output)) in str(refused.value)  # and the output
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_output_in_a_linked_folder_the_input_never_reaches_is_fine(
    tiny_model: Path, tmp_path: Path
) -> None:
    write_jsonl(tmp_path / "in" / "a.jsonl", chat_rows(3))
    (tmp_path / "other").mkdir()
    (tmp_path / "in" / "more").symlink_to("../other")
    spec = job_dict(tiny_model, tmp_path / "in" / "*.jsonl", tmp_path / "other" / "out")
    for _ in range(2):  # the rerun lists the same single file
        report = run_job(spec, show_progress=False)
        assert report.status == "complete" and report.rows_ok == 3


@pytest.mark.parametrize("output_of", [lambda d: d / "out", lambda d: d], ids=["inside", "over"])
def test_a_folder_named_like_a_glob_is_that_folder(tiny_model: Path, tmp_path: Path, output_of):
    """run[1] is a folder (the reader reads it as one), not a glob of run1: an output inside
    it was let through, and the next run read the job's own files as input rows."""
    data = tmp_path / "run[1]"
    write_jsonl(data / "in.jsonl", chat_rows(3))
    (tmp_path / "run1").mkdir()  # what run[1] matches as a glob
    spec = job_dict(tiny_model, data if output_of(data) != data else data / "in.jsonl",
                    output_of(data))  # fmt: skip
    with pytest.raises(JobSpecError, match="inside the input folder|contains the input"):
        run_job(spec, show_progress=False)
    assert sorted(p.name for p in data.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize("pattern", ["in.jsonl", "*.jsonl"])
def test_output_beside_the_input_files_is_fine(
    tiny_model: Path, tmp_path: Path, pattern: str
) -> None:
    write_jsonl(tmp_path / "data" / "in.jsonl", chat_rows(3))
    spec = job_dict(tiny_model, tmp_path / "data" / pattern, tmp_path / "data" / "out")
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_ok == 3


# 4. Gzip input -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["auto", "jsonl"])
def test_gzip_input_is_read(tiny_model: Path, tmp_path: Path, fmt: str) -> None:
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in chat_rows(7)).encode()))
    spec = job_dict(tiny_model, src, tmp_path / "out")
    spec["input"]["format"] = fmt
    report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_ok, report.rows_failed) == ("complete", 7, 0)


# 5. Poison rows are row errors, on the first run and on every rerun ------------------------


POISON = [
    '{"id": "p1", "messages": [{"role": "user", "content": "bad \\ud800 text"}]}',
    '{"id": "p2\\udfff", "messages": [{"role": "user", "content": "fine"}]}',
    '{"id": "p3", "topic": "x\\ud800", "messages": [{"role": "user", "content": "fine"}]}',
    '{"id": "p4", "topic": {"k": ["\\udc00"]}, "messages": [{"role": "user", "content": "f"}]}',
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_unpaired_surrogates_are_row_errors(
    tiny_model: Path, tmp_path: Path, fmt: str, capsys
) -> None:
    good = [json.dumps(r) for r in chat_rows(4)]
    src = write_jsonl(tmp_path / "in.jsonl", [good[0], *POISON, *good[1:]])
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, output={"format": fmt})
    report = run_job(spec, show_progress=False)
    assert (report.status, report.rows_ok, report.rows_failed) == ("complete", 4, 4)
    errors = read_jsonl_dir(out / "errors")
    assert len(errors) == 4 and all("not valid Unicode" in e["error"] for e in errors)
    assert {e["error"].split(": ")[0].rsplit(":", 1)[1] for e in errors} == {"2", "3", "4", "5"}
    for path in (out / "errors").iterdir():
        path.read_bytes().decode("utf-8")  # every byte written is valid UTF-8

    job = write_job(tmp_path, spec)
    assert run_cli(job, "--dry-run") == 0
    assert "(4 bad)" in capsys.readouterr().out


def test_a_row_that_cannot_be_written_is_an_error_not_a_crash(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Passthrough values Arrow cannot hold together with others in one shard still commit."""
    rows = chat_rows(4)
    rows[1]["topic"] = 10**30  # beyond int64: the shard falls back, the row is written
    rows[2]["topic"] = {"deep": [[[1.5]]]}
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, output={"format": "parquet", "rows_per_shard": 8})
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_ok + report.rows_failed == 4
    table = pq.read_table(out / "shards" / "part-00000.parquet")
    assert table.num_rows == report.rows_ok


# 6. Errors that could be found first are found first ---------------------------------------


def test_openai_batch_output_needs_batch_input_up_front(
    tiny_model: Path, tmp_path: Path, capsys
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    job = write_job(tmp_path, job_dict(tiny_model, src, tmp_path / "out", output={
        "format": "openai-batch"}))  # fmt: skip
    start = time.monotonic()
    assert run_cli(job, "--dry-run") == INVALID
    assert run_cli(job) == INVALID
    assert time.monotonic() - start < 10  # no model loaded, no inference
    err = capsys.readouterr().err
    assert "output.format" in err and "OpenAI Batch" in err
    assert not (tmp_path / "out").exists()


def test_parquet_without_the_prompt_column_fails_up_front(
    tiny_model: Path, tmp_path: Path, capsys
) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "question": ["q1", "q2"]}), src)
    spec = job_dict(tiny_model, src, tmp_path / "out")
    spec["input"] |= {"messages_column": None, "prompt_column": "prompt", "passthrough_columns": []}
    job = write_job(tmp_path, spec)
    assert run_cli(job) == INVALID
    err = capsys.readouterr().err
    assert "input.prompt_column" in err and "question" in err
    assert not (tmp_path / "out").exists()


def test_an_empty_first_part_file_does_not_decide_the_columns(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A zero-row part file without the prompt column, sorted first, stopped the job (exit 2)
    though every row's file has the column."""
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"id": pa.array([], pa.string())}), data / "part-0.parquet")
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["p1", "p2"]}), data / "part-1.parquet")
    spec = job_dict(tiny_model, data / "*.parquet", tmp_path / "out")
    spec["input"] |= {"messages_column": None, "prompt_column": "prompt", "passthrough_columns": []}
    assert run_job(spec, show_progress=False).rows_ok == 2


# 7. A YAML bomb ----------------------------------------------------------------------------


def test_yaml_bomb_is_refused_at_once(tiny_model: Path, tmp_path: Path, capsys) -> None:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]")
    spec = job_dict(tiny_model, tmp_path / "in.jsonl", tmp_path / "out")
    body = yaml.safe_dump(spec).replace("sampling:\n", "sampling:\n  stop: *l8\n")
    job = tmp_path / "bomb.yaml"
    job.write_text("\n".join(lines) + "\n" + body)
    start = time.monotonic()
    assert run_cli(job) == INVALID
    assert time.monotonic() - start < 2
    err = capsys.readouterr().err
    assert len(err) < 2000 and str(job) in err


# 8. Exit codes -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("section", "values", "needle"),
    [
        ("engine", {"device": "banana"}, "engine.device"),
        ("output", {"path": ""}, "output.path"),
        ("output", {"rows_per_shard": True}, "output.rows_per_shard"),
        ("model", {"source": "/no/such/model.gguf"}, "model.source"),
        ("input", {"path": "/no/such/input.jsonl"}, "input.path"),
    ],
    ids=["device", "empty-output", "bool-as-int", "missing-model", "missing-input"],
)
def test_bad_spec_values_exit_2_naming_the_key(
    tiny_model: Path, tmp_path: Path, section: str, values: dict, needle: str, capsys
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    spec = job_dict(tiny_model, src, tmp_path / "out")
    spec[section] |= values
    assert run_cli(write_job(tmp_path, spec), "--quiet") == INVALID
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_unreachable_s3_endpoint_exits_75_naming_the_key(
    tiny_model: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """A store out of reach at the start is an outage to a scheduled job (retry later), as
    it is mid-run; the message still says to check the address."""
    pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {
        "endpoint_url": f"http://127.0.0.1:{_free_port()}",  # nothing listens there
        "key": "testing",
        "secret": "testing",
        "skip_instance_cache": True,
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    spec = job_dict(tiny_model, src, "s3://bucket/out/")
    spec["output"]["storage_options"] = options
    assert run_cli(write_job(tmp_path, spec), "--quiet") == TEMPORARY
    err = capsys.readouterr().err
    assert "output.path" in err and "endpoint_url" in err and "testing" not in err

    spec = job_dict(tiny_model, "s3://bucket/in.jsonl", tmp_path / "out")
    spec["input"]["storage_options"] = options
    assert run_cli(write_job(tmp_path, spec), "--quiet") == TEMPORARY
    err = capsys.readouterr().err
    assert "input.path" in err and "testing" not in err


# 9. Messages -------------------------------------------------------------------------------


def test_error_lines_name_their_location_once_and_duplicates_keep_their_own_id(
    tiny_model: Path, tmp_path: Path
) -> None:
    rows = chat_rows(3)
    lines = [json.dumps(r) for r in rows] + ['{"id": "x", "a": "unterminated', json.dumps(rows[0])]
    src = write_jsonl(tmp_path / "f.jsonl", lines)
    out = tmp_path / "out"
    run_job(job_dict(tiny_model, src, out), show_progress=False)
    errors = {e["id"]: e["error"] for e in read_jsonl_dir(out / "errors")}
    assert set(errors) == {"f.jsonl:4", "f.jsonl:5"}  # the duplicate does not reuse r0000
    bad_json, duplicate = errors["f.jsonl:4"], errors["f.jsonl:5"]
    assert bad_json.count("f.jsonl:4") == 1 and bad_json.startswith(f"{src}:4: ")
    assert "at at" not in bad_json and "column 18" in bad_json
    assert duplicate.startswith(f"{src}:5: duplicate id 'r0000'")
    assert "r0000" not in errors and "r0000" in _ids(out / "shards")


def test_fingerprint_refusal_names_what_changed(tiny_model: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    out = tmp_path / "out"
    run_job(job_dict(tiny_model, src, out), show_progress=False)
    changed = job_dict(tiny_model, src, out, sampling={"max_tokens": 5, "temperature": 0.5})
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(changed, show_progress=False)
    message = str(info.value)
    assert "sampling.max_tokens: 8 -> 5" in message
    assert "sampling.temperature: 0.0 -> 0.5" in message
    assert "--fresh" in message


# 10. Committed shards are verified on resume -----------------------------------------------


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_vanished_shards_are_recomputed(tiny_model: Path, tmp_path: Path, damage: str) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(10))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out)
    run_job(spec, show_progress=False)
    reference = {r["id"]: r["text"] for r in read_jsonl_dir(out / "shards")}
    victim = out / "shards" / "part-00001.jsonl"
    if damage == "delete":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:10])
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.shards_recomputed == 1
    assert report.rows_this_run == 4 and report.rows_ok == 10
    assert {r["id"]: r["text"] for r in read_jsonl_dir(out / "shards")} == reference
    saved = json.loads((out / "report.json").read_text())
    assert saved["shards_recomputed"] == 1


def test_a_removed_shards_folder_is_one_warning_not_one_per_shard(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An audit: a rerun after ``shards/`` was removed logged "shard N is recomputed" once
    per shard (800+ lines before the summary); now one line gives the count and the first
    shards, and report.json keeps the whole list beside the count."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(12))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, sampling={"max_tokens": 2})
    spec["output"]["rows_per_shard"] = 1
    run_job(spec, show_progress=False)
    shutil.rmtree(out / "shards")
    caplog.clear()
    with caplog.at_level("WARNING", logger="tokenmill"):
        report = run_job(spec, show_progress=False)
    lines = [r.getMessage() for r in caplog.records if "recomputed" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("12 committed shards are recomputed")
    assert "shards 0, 1, 2, 3, 4, ..." in lines[0] and "shards_recomputed_list" in lines[0]
    assert (report.status, report.shards_recomputed, report.rows_ok) == ("complete", 12, 12)
    saved = json.loads((out / "report.json").read_text())
    assert saved["shards_recomputed"] == 12 and saved["shards_recomputed_list"] == list(range(12))


def _lose_shard_0_after_shard_2(out: Path, monkeypatch: pytest.MonkeyPatch) -> Callable:
    """Make the run's commit of shard 2 remove shard 0's file (another machine's run, or a
    person); returns the real ``commit_shard`` to put back."""
    from tokenmill.jobs import shard_writer

    commit = shard_writer.commit_shard

    def commit_then_lose_shard_0(store, shard, *args, **kwargs):
        record = commit(store, shard, *args, **kwargs)
        if shard == 2:
            os.remove(out / "shards" / "part-00000.jsonl")
        return record

    monkeypatch.setattr(shard_writer, "commit_shard", commit_then_lose_shard_0)
    return commit


def test_a_run_whose_committed_shard_vanishes_meanwhile_is_not_complete(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another machine's run with --fresh (a lock this one cannot see) removes a shard this
    run committed: the run fails naming it instead of saying "complete" with 4 rows missing,
    and a rerun recomputes it."""
    from tokenmill.jobs import shard_writer
    from tokenmill.jobs.manifest import OutputChangedError

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(12))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out)
    commit = _lose_shard_0_after_shard_2(out, monkeypatch)
    with pytest.raises(OutputChangedError, match=r"shard 0: shards/part-00000.jsonl is missing"):
        run_job(spec, show_progress=False)
    assert json.loads((out / "report.json").read_text())["status"] == "failed"
    assert not json.loads((out / "test.manifest.json").read_text())["complete"]
    monkeypatch.setattr(shard_writer, "commit_shard", commit)
    report = run_job(spec, show_progress=False)
    assert (report.status, report.shards_recomputed, report.rows_this_run) == ("complete", 1, 4)
    ids = _ids(out / "shards")
    assert len(ids) == len(set(ids)) == 12  # every row once


def test_run_job_says_a_vanished_shard_without_a_traceback(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its message says what happened and what to do; run-job printed a traceback under it,
    as for a failure nobody foresaw (an audit)."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(12))
    out = tmp_path / "out"
    job = write_job(tmp_path, job_dict(tiny_model, src, out))
    _lose_shard_0_after_shard_2(out, monkeypatch)
    assert run_cli(job, "--quiet") == 1
    err = capsys.readouterr().err
    assert "1 shard this job committed changed under this run" in err and "rerun" in err
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_a_vanished_shard_and_manifest_say_to_rerun_with_fresh(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another machine's --fresh took the manifest and its journal too: the run said "rerun
    to recompute them", and that rerun was refused (the shards left have no manifest); the
    advice is now the one that works, --fresh."""
    from tokenmill.jobs import shard_writer
    from tokenmill.jobs.manifest import ManifestError, OutputChangedError

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(12))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out)
    commit = shard_writer.commit_shard

    def commit_then_lose_shard_0_and_the_manifest(store, shard, *args, **kwargs):
        record = commit(store, shard, *args, **kwargs)
        if shard == 2:
            os.remove(out / "shards" / "part-00000.jsonl")
            os.remove(out / "test.manifest.json")
            shutil.rmtree(out / "test.manifest.d", ignore_errors=True)
        return record

    monkeypatch.setattr(shard_writer, "commit_shard", commit_then_lose_shard_0_and_the_manifest)
    with pytest.raises(OutputChangedError) as failed:
        run_job(spec, show_progress=False)
    assert "rerun with --fresh" in str(failed.value)
    assert "rerun to recompute" not in str(failed.value)
    monkeypatch.setattr(shard_writer, "commit_shard", commit)
    with pytest.raises(ManifestError, match="--fresh"):  # what a plain rerun says
        run_job(spec, show_progress=False)
    report = run_job(spec, fresh=True, show_progress=False)  # what the advice says works
    assert (report.status, report.rows_ok) == ("complete", 12)


def test_a_stale_journal_record_does_not_override_a_manifest_that_matches_the_files(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A version without the journal finished the job over records this one had left (a
    rollback mid-job): the records named files of other sizes, which made this version
    recompute shards the manifest's own records still matched."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(12))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out)
    run_job(spec, show_progress=False)
    manifest = json.loads((out / "test.manifest.json").read_text())
    stale = dict(manifest["shards"]["1"], data_bytes=manifest["shards"]["1"]["data_bytes"] + 7)
    journal = out / "test.manifest.d"
    journal.mkdir(exist_ok=True)
    (journal / "00000001.json").write_text(json.dumps(stale))
    report = run_job(spec, show_progress=False)
    assert (report.status, report.shards_recomputed, report.rows_this_run) == ("complete", 0, 0)
    assert not (journal / "00000001.json").exists()  # the stale record went
    assert (
        json.loads((out / "test.manifest.json").read_text())["shards"]["1"]
        == (manifest["shards"]["1"])
    )


def test_a_manifest_without_sizes_is_still_checked_for_missing_files(
    tiny_model: Path, tmp_path: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(8))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out)
    run_job(spec, show_progress=False)
    with _manifest(out) as manifest:
        for shard in manifest["shards"].values():  # as written before sizes were recorded
            del shard["data_bytes"], shard["error_bytes"]
    os.remove(out / "shards" / "part-00000.jsonl")
    report = run_job(spec, show_progress=False)
    assert report.shards_recomputed == 1 and report.rows_ok == 8


def test_resume_refuses_a_changed_kv_cache_dtype_or_model_length(
    tiny_model: Path, tmp_path: Path
) -> None:
    """(The grammar library, which counts only for constrained rows:
    test_grammar_library_resume.py.)"""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    out = tmp_path / "out"
    run_job(job_dict(tiny_model, src, out), show_progress=False)
    for key, value, expected in (
        ("kv_cache_dtype", "fp8", 'engine.kv_cache_dtype: "auto" -> "fp8"'),
        ("max_model_len", 40, "engine.max_model_len: null -> 40"),  # cuts rows elsewhere
    ):
        changed = job_dict(tiny_model, src, out, engine={key: value})
        with pytest.raises(FingerprintMismatchError) as info:
            run_job(changed, show_progress=False)
        assert expected in str(info.value)
    # the defaults written out resume the job begun without them (and change nothing)
    same = job_dict(
        tiny_model,
        src,
        out,
        engine={"kv_cache_dtype": "auto", "structured_output_backend": "llguidance",
                "max_model_len": "auto"},
    )  # fmt: skip
    run_job(same, show_progress=False)


def test_resume_refuses_a_model_saved_again_at_the_same_sizes(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Same file names and sizes, other weights (a checkpoint saved again in place): refused,
    named. A manifest from before the model's content was recorded still resumes."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    out = tmp_path / "out"
    spec = job_dict(model, src, out)
    run_job(spec, show_progress=False)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(4) if data[-4:] != bytes(4) else b"\x01\x02\x03\x04"  # the last weight
    weights.write_bytes(bytes(data))
    with pytest.raises(FingerprintMismatchError, match="model_content: the model's files changed"):
        run_job(spec, show_progress=False)
    with _manifest(out) as manifest:
        del manifest["settings"]["model_content"]
    assert run_job(spec, show_progress=False).status == "complete"


def test_a_moved_model_resumes_and_a_changed_one_is_refused(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The model's folder copied elsewhere (a fresh clone, a venv rebuilt in another folder,
    a mount at another path), same files and content: the job resumes, its committed rows
    kept, each row once. The copy then changed in one byte at the same size: refused, named
    as the content, not as the path."""
    first, moved = tmp_path / "a" / "model", tmp_path / "b" / "model"
    shutil.copytree(tiny_model, first)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(10))
    out = tmp_path / "out"
    run_job(job_dict(first, src, out), show_progress=False)
    reference = {r["id"]: r["text"] for r in read_jsonl_dir(out / "shards")}
    (out / "shards" / "part-00002.jsonl").unlink()  # the last shard: computed again
    shutil.copytree(first, moved)
    shutil.rmtree(first)
    spec = job_dict(moved, src, out)
    assert dry_run(JobSpec.from_dict(spec)).resumable  # as the run decides
    other = job_dict(moved, src, out, sampling={"max_tokens": 5})
    with pytest.raises(FingerprintMismatchError) as info:  # named: what refused it, not the move
        run_job(other, show_progress=False)
    assert "sampling.max_tokens: 8 -> 5" in str(info.value) and "model.dir" not in str(info.value)
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.rows_resumed == 8
    assert report.rows_this_run == 2 and report.rows_ok == 10
    assert {r["id"]: r["text"] for r in read_jsonl_dir(out / "shards")} == reference
    assert _ids(out / "shards") == sorted(reference)  # each row once
    with _manifest(out) as manifest:  # the manifest now holds the new place
        assert manifest["settings"]["model"]["dir"] == str(moved.resolve())
        manifest["complete"] = False
    weights = moved / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last weight's lowest bits: same size, other content
    weights.write_bytes(bytes(data))
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(spec, show_progress=False)
    assert "model_content: the model's files changed" in str(info.value)


def test_a_model_file_in_another_venv_is_the_same_model(tmp_path: Path) -> None:
    """An alias's GGUF file inside a venv built again elsewhere: the fingerprint its old path
    gave is one of the new settings' earlier ones; a file of the same name and size whose
    sampled content differs is not, nor is any where the manifest has no content."""
    first, again = tmp_path / "old" / "m.gguf", tmp_path / "new" / "m.gguf"
    for path in (first, again):
        path.parent.mkdir()
        path.write_bytes(bytes(range(256)) * (40 << 10))  # 10 MiB: past what is read whole
    kept = {"model": model_identity(first), "model_content": model_content(first), "input": "i"}
    now = {**kept, "model": model_identity(again), "model_content": model_content(again)}
    assert fingerprint(kept) != fingerprint(now)  # (the hash holds the path)
    assert fingerprint(kept) in earlier_fingerprints(now, None, kept=kept)
    assert changed_settings(kept, now) == []  # nothing to name: the move alone resumes
    old_manifest = {key: value for key, value in kept.items() if key != "model_content"}
    assert fingerprint(kept) not in earlier_fingerprints(now, None, kept=old_manifest)
    with again.open("r+b") as f:  # the first sampled chunk
        f.write(b"\xff")
    now["model_content"] = model_content(again)
    assert fingerprint(kept) not in earlier_fingerprints(now, None, kept=kept)


def test_resume_refuses_dtype_auto_resolved_on_another_kind_of_device(
    tiny_model: Path, tmp_path: Path
) -> None:
    """model.dtype auto is fp32 on a CPU and the checkpoint's dtype on a GPU: a job begun on
    one and resumed on the other would mix them. (The GPU side is written into the
    manifest here: this box has none.)"""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out)
    run_job(spec, show_progress=False)
    with _manifest(out) as manifest:
        assert manifest["settings"]["resolved_dtype"] == "float32"
        manifest["settings"]["resolved_dtype"] = "bfloat16"
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(spec, show_progress=False)
    assert 'resolved_dtype: "bfloat16" -> "float32" (model.dtype auto on another' in str(info.value)


def test_a_changed_input_is_named_in_words(tiny_model: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    out = tmp_path / "out"
    run_job(job_dict(tiny_model, src, out), show_progress=False)
    write_jsonl(src, chat_rows(4))
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(job_dict(tiny_model, src, out), show_progress=False)
    message = str(info.value)
    assert "input: the input changed: its files (which, their sizes" in message
    assert message.count('"') % 2 == 0  # shortened values keep their quotes balanced
    # what kind of change: the same file, more bytes (a file added says files: 1 -> 2)
    grown = src.stat().st_size
    assert "input_files.files" not in message
    assert f"-> {grown} (bytes in the input files)" in message, message


def test_a_manifest_without_input_counts_resumes(tiny_model: Path, tmp_path: Path) -> None:
    """The input's file and byte counts sit beside the fingerprint: a job begun before
    they were kept resumes."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    out = tmp_path / "out"
    run_job(job_dict(tiny_model, src, out), show_progress=False)
    with _manifest(out) as manifest:
        assert manifest["settings"]["input_files"] == {"files": 1, "bytes": src.stat().st_size}
        del manifest["settings"]["input_files"]
        manifest["complete"] = False
    report = run_job(job_dict(tiny_model, src, out), show_progress=False)
    assert report.status == "complete"


def test_a_run_that_writes_nothing_leaves_no_output_folder(tmp_path: Path) -> None:
    """A model that cannot be found is found out after the output's lock is taken: the
    folder the lock made goes with it, rather than staying behind holding only the lock."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    out = tmp_path / "new" / "out"
    with pytest.raises(JobSpecError, match="model.source"):
        run_job(job_dict(tmp_path / "no-such-model", src, out), show_progress=False)
    assert not out.exists()
    out.mkdir(parents=True)  # a folder the user made stays, empty
    with pytest.raises(JobSpecError, match="model.source"):
        run_job(job_dict(tmp_path / "no-such-model", src, out), show_progress=False)
    assert out.is_dir() and list(out.iterdir()) == []


def test_a_model_that_fails_to_load_exits_2_and_the_fixed_rerun_is_not_refused(
    tiny_model: Path, tmp_path: Path, capsys
) -> None:
    """Damaged weights are found out after the output is claimed (its manifest written):
    exit 2 naming model.source (it was exit 1, "rerun to resume", forever); the rerun with
    the weights restored then runs, as no shard holds progress of the failed settings (it
    was refused as "progress made with other settings")."""
    model = shutil.copytree(tiny_model, tmp_path / "model")
    weights = model / "model.safetensors"
    whole = weights.read_bytes()
    tensors = load_file(weights)  # NaN inside: the header reads, the load refuses it
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    job = write_job(tmp_path, job_dict(model, src, tmp_path / "out"))
    assert run_cli(job, "--quiet") == INVALID
    err = capsys.readouterr().err
    assert f"model.source '{model}' cannot be loaded" in err and "NaN" in err
    weights.write_bytes(whole)
    assert run_cli(job, "--quiet") == 0


def test_a_run_reads_the_files_its_fingerprint_holds_while_its_folder_fills(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The fingerprint and the reads listed the input apart: a file that landed between them
    was read but not fingerprinted, and every rerun, with nothing changed since, was refused
    as "the input changed". The run now reads the files it listed once."""
    import logging

    folder = tmp_path / "in"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", chat_rows(4))

    class LandsWhileLoading(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("loading model"):
                write_jsonl(folder / "b.jsonl", chat_rows(4, start=4))

    handler = LandsWhileLoading()
    logging.getLogger("tokenmill.jobs").addHandler(handler)
    try:
        spec = job_dict(tiny_model, folder, tmp_path / "out")
        with caplog.at_level(logging.INFO, logger="tokenmill.jobs"):
            report = run_job(spec, show_progress=False)
    finally:
        logging.getLogger("tokenmill.jobs").removeHandler(handler)
    assert (folder / "b.jsonl").exists()
    assert (report.status, report.rows_total, report.rows_ok) == ("complete", 4, 4)
    # b.jsonl came after the run listed its input: to the rerun the input has changed
    with pytest.raises(FingerprintMismatchError, match="input"):
        run_job(spec, show_progress=False)
    (folder / "b.jsonl").unlink()
    assert run_job(spec, show_progress=False).rows_this_run == 0  # as the run left it


def test_a_rerun_with_nothing_new_leaves_the_manifest_as_it_is(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A finished job's rerun (cron) rewrote its whole manifest every time: 0.7 s and a
    7 MB write at 30,000 shards, one full PUT a rerun on S3."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    spec = job_dict(tiny_model, src, tmp_path / "out")
    run_job(spec, show_progress=False)
    manifest = tmp_path / "out" / "test.manifest.json"
    before = (manifest.stat().st_mtime_ns, manifest.read_bytes())
    time.sleep(0.01)
    again = run_job(spec, show_progress=False)
    assert (again.status, again.rows_this_run) == ("complete", 0)
    assert (manifest.stat().st_mtime_ns, manifest.read_bytes()) == before
    spec["sampling"]["max_tokens"] = 9  # another fingerprint: refused, nothing written
    with pytest.raises(FingerprintMismatchError):
        run_job(spec, show_progress=False)
    assert (manifest.stat().st_mtime_ns, manifest.read_bytes()) == before
