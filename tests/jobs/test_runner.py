"""The local job runner end to end on the tiny model: outputs, errors, resume, refusal, lock."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.jobs.job_helpers import (
    chat_rows,
    committed_shards,
    job_dict,
    read_jsonl_dir,
    write_jsonl,
)
from tokenmill import run_job, submit
from tokenmill.jobs.cli import main as cli_main
from tokenmill.jobs.lock import JobLock
from tokenmill.jobs.manifest import FingerprintMismatchError
from tokenmill.jobs.report import JobReport

ROOT = Path(__file__).resolve().parents[2]
BAD_LINES = [
    "{not json",
    json.dumps({"messages": [{"role": "user", "content": "no id"}]}),
    json.dumps({"id": "r0001", "messages": [{"role": "user", "content": "duplicate"}]}),
    json.dumps({"id": "bad-role", "messages": [{"role": "wizard", "content": "hi"}]}),
    json.dumps({"id": "too-long", "messages": [{"role": "user", "content": "x" * 2000}]}),
]


def _outputs(out: Path) -> tuple[list[dict], list[dict]]:
    return read_jsonl_dir(out / "shards"), read_jsonl_dir(out / "errors")


def test_jsonl_job_writes_every_row_once(tiny_model: Path, tmp_path: Path) -> None:
    rows = chat_rows(10)
    lines = [json.dumps(r) for r in rows[:5]] + BAD_LINES + [json.dumps(r) for r in rows[5:]]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    report = run_job(job_dict(tiny_model, src, out), show_progress=False)

    assert report.status == "complete"
    assert (report.rows_ok, report.rows_failed, report.rows_total) == (10, 5, 15)
    ok, errors = _outputs(out)
    assert sorted(r["id"] for r in ok) == sorted(r["id"] for r in rows)
    assert all(r["topic"] == f"t{int(r['id'][1:]) % 3}" for r in ok)
    assert all(r["completion_tokens"] > 0 and r["prompt_tokens"] > 0 for r in ok)
    assert len(errors) == 5
    text = " ".join(e["error"] for e in errors)
    for needle in ("JSON", "id", "duplicate", "wizard", "context"):
        assert needle in text, needle
    saved = json.loads((out / "report.json").read_text())
    assert saved["status"] == "complete" and saved["rows_ok"] == 10
    manifest = json.loads((out / "test.manifest.json").read_text())
    assert manifest["complete"] and manifest["total_rows"] == 15

    again = run_job(job_dict(tiny_model, src, out), show_progress=False)
    assert again.status == "complete" and again.rows_this_run == 0 and again.rows_ok == 10
    assert again.model == str(tiny_model) and again.completion_tokens == 0  # none this run


def test_a_complete_jobs_stale_report_is_written_again(tiny_model: Path, tmp_path: Path) -> None:
    """Killed between marking the manifest complete and writing report.json: the rerun has
    nothing to do but leaves no stale report ("cancelled" from an earlier run, or none),
    report.html too (a review: the rerun wrote report.json alone), each saying the rows
    were committed by earlier runs."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(5))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out)
    run_job(spec, show_progress=False)
    report, page = out / "report.json", out / "report.html"
    for stale in ('{"status": "cancelled", "rows_ok": 2}', None):
        if stale is None:
            report.unlink()
            page.unlink()
        else:
            report.write_text(stale)
        assert run_job(spec, show_progress=False).rows_this_run == 0
        saved = json.loads(report.read_text())
        assert saved["status"] == "complete" and saved["rows_ok"] == 5
        assert saved["rows_resumed"] == 5 and saved["rows_total"] == 5
        assert "tokenmill job test: complete" in page.read_text()
    before = report.read_bytes()  # a report that says complete is the completing run's: kept
    run_job(spec, show_progress=False)
    assert report.read_bytes() == before


def test_a_disk_full_at_report_html_leaves_report_json_for_the_rerun(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An audit: report.json was written before report.html. The disk filled between the
    two: report.json said "complete", report.html failed, report.json saying "failed" failed
    too, and the run exited 75 saying rerun; the rerun found report.json complete, had
    nothing to do and never wrote the page (an earlier run's "failed" page stayed for good).
    The warning blamed report.json. report.json now comes last: it stays as it was, the
    warning names report.html, and the rerun writes both."""
    import errno
    import logging

    from tokenmill.io.storage import OutputStore

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(40))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out)
    report, page = out / "report.json", out / "report.html"
    _fail_after(monkeypatch, 10)
    with pytest.raises(RuntimeError, match="injected"):
        run_job(spec, show_progress=False)
    monkeypatch.undo()
    assert "tokenmill job test: failed" in page.read_text()

    write, full = OutputStore.write_atomic, [False]

    def disk_fills_at_the_page(self: OutputStore, name: str, data: bytes) -> None:
        full[0] = full[0] or name == "report.html"  # and stays full: report.json fails too
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device", self.path(name))
        write(self, name, data)

    monkeypatch.setattr(OutputStore, "write_atomic", disk_fills_at_the_page)
    with (
        caplog.at_level(logging.WARNING, logger="tokenmill.jobs"),
        pytest.raises(OSError, match="No space left"),
    ):
        run_job(spec, show_progress=False)
    assert json.loads(report.read_text())["status"] == "failed"  # the earlier run's report
    assert "could not write report.html saying the run failed" in caplog.text
    assert "could not write report.json" not in caplog.text
    monkeypatch.undo()

    again = run_job(spec, show_progress=False)
    assert again.status == "complete" and again.rows_this_run == 0
    saved = json.loads(report.read_text())
    assert saved["status"] == "complete" and saved["rows_ok"] + saved["rows_failed"] == 40
    text = page.read_text()
    assert "tokenmill job test: complete" in text
    assert f'data-key="wall_seconds" data-value="{saved["wall_seconds"]}"' in text


def test_a_complete_jobs_missing_or_stale_page_is_drawn_again_from_report_json(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What earlier versions left (report.json saying complete, report.html missing or
    another run's): a found-complete run draws the page again from report.json, which it
    keeps; a page that shows report.json is left alone (no matplotlib, no write)."""
    from tokenmill.jobs import runner

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(5))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out)
    run_job(spec, show_progress=False)
    report, page = out / "report.json", out / "report.html"
    before, drawn = report.read_bytes(), page.read_bytes()
    wall = json.loads(before)["wall_seconds"]
    for stale in (b"<title>tokenmill job test: failed</title>", None):
        if stale is None:
            page.unlink()
        else:
            page.write_bytes(stale)
        assert run_job(spec, show_progress=False).rows_this_run == 0
        assert report.read_bytes() == before  # the completing run's report, kept
        text = page.read_text()
        assert "tokenmill job test: complete" in text
        assert f'data-key="wall_seconds" data-value="{wall}"' in text  # its numbers
        assert text.split("<h2", 1)[0] == drawn.decode().split("<h2", 1)[0]  # its summary

    def no_drawing(*args: object) -> None:
        raise AssertionError("a page that shows report.json was drawn again")

    monkeypatch.setattr(runner, "write_report_html", no_drawing)
    repaired = page.read_bytes()
    run_job(spec, show_progress=False)
    assert page.read_bytes() == repaired and report.read_bytes() == before


def _count(cls: type) -> int:
    """Live objects of exactly ``cls`` (``type(o)``, not isinstance: that asks lazy-import
    proxies of other packages, e.g. Airflow's, for ``__class__``, which imports them)."""
    import gc

    return sum(type(o) is cls for o in gc.get_objects())


def test_a_run_that_fails_mid_stream_leaves_no_request_behind(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader's tokenizer fails with rows in the engine: the run's requests are aborted
    on the way out. They stayed in the scheduler's batch slots, a cycle through a numpy
    object array the garbage collector cannot see: every failed run in a long-lived
    process (an Airflow worker, a notebook) kept its slots' arrays for good."""
    import gc

    from tokenmill.engine.core.request import Request
    from tokenmill.jobs import ready_rows

    prepare, calls = ready_rows.RowPreparer.__call__, [0]

    def failing(self, rows):
        calls[0] += 1
        if calls[0] == 8:  # the engine is full by then
            raise RuntimeError("tokenizer crashed")
        return prepare(self, rows)

    monkeypatch.setattr(ready_rows.RowPreparer, "__call__", failing)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(1000))
    spec = job_dict(tiny_model, src, tmp_path / "out", sampling={"max_tokens": 64},
                    engine={"max_num_seqs": 256, "kv_cache_memory": 64 << 20})  # fmt: skip
    gc.collect()
    before = _count(Request)
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        run_job(spec, show_progress=False)
    gc.collect()
    assert _count(Request) == before


def test_a_failed_run_says_so_in_report_json(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that failed left the last run's report.json as it was ("cancelled" here), so
    whatever watched the job (the Airflow operator returns its path) read stale numbers."""
    from tokenmill.jobs import runner

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    spec = job_dict(tiny_model, src, tmp_path / "out")
    cancelled = threading.Event()
    cancelled.set()
    assert run_job(spec, cancel=cancelled, show_progress=False).status == "cancelled"

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(runner, "_load_executor", no_memory)
    with pytest.raises(RuntimeError, match="allocate"):
        run_job(spec, show_progress=False)
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["status"] == "failed"
    assert saved["error"] == "RuntimeError: DefaultCPUAllocator: can't allocate memory"


def test_wall_seconds_runs_from_the_call_to_the_reports_writing(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wall_seconds was taken as the engine's stream ended, before the input's re-check, the
    manifest's save and the engine's close: a 9.05 s job said 8.2 s, against the scheduler's
    time. It now runs from run_job's call to the report's writing."""
    from tokenmill.jobs import runner

    check, write = runner._check_input_unchanged, runner._write_report
    written: list[float] = []

    def slow_check(*args: object) -> None:  # a re-read input on a slow store
        time.sleep(0.5)
        check(*args)

    def timed_write(*args: object) -> None:
        written.append(time.monotonic())
        write(*args)

    monkeypatch.setattr(runner, "_check_input_unchanged", slow_check)
    monkeypatch.setattr(runner, "_write_report", timed_write)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    called = time.monotonic()
    report = run_job(job_dict(tiny_model, src, tmp_path / "out"), show_progress=False)
    assert report.status == "complete"
    assert report.wall_seconds == pytest.approx(written[0] - called, abs=0.05)
    assert report.wall_seconds >= report.model_load_seconds + report.generation_seconds + 0.5
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["wall_seconds"] == report.wall_seconds


def test_a_kv_cache_too_small_for_the_jobs_context_is_refused(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The engine lowered max_model_len to what the KV cache held: a run killed and resumed
    with other memory cut rows at two lengths in one output (22 and 24 tokens), exit 0."""
    from tokenmill.jobs.spec import JobSpecError

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    small = {"kv_cache_memory": 200_000}  # 24 blocks of 16 tokens: 384 < the model's 1,024
    spec = job_dict(tiny_model, src, tmp_path / "out", engine=small)
    said = r"^engine: the KV cache holds 384 tokens, less than the 1024-token context .* Set "
    with pytest.raises(JobSpecError, match=said + r"engine.max_model_len to 384 or less"):
        run_job(spec, show_progress=False)
    assert not (tmp_path / "out" / "shards").exists()
    fits = job_dict(tiny_model, src, tmp_path / "out", engine={**small, "max_model_len": 384})
    assert run_job(fits, show_progress=False).rows_ok == 2


def test_a_refused_kv_cache_logs_no_lowered_context(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine logged "max_model_len 1024 lowered to 384" and built its KV cache, then the
    job refused to run below 1,024 tokens: a lowering that never ran, just before the exit's
    real reason. The engine now refuses before the cache, and says nothing of lowering."""
    from tokenmill.jobs.spec import JobSpecError

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    spec = job_dict(tiny_model, src, tmp_path / "out", engine={"kv_cache_memory": 200_000})
    caplog.set_level(logging.INFO)
    with pytest.raises(JobSpecError, match="the KV cache holds 384 tokens"):
        run_job(spec, show_progress=False)
    assert "lowered to" not in caplog.text and "engine ready" not in caplog.text


def test_preemptions_for_want_of_kv_cache_are_reported(tiny_model: Path, tmp_path: Path) -> None:
    """An audit: rows preempted over and over in a small KV cache (the run several times
    slower, each preempted row recomputed) left no trace in report.json or the summary."""
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps(r) for r in chat_rows(4)])
    # 9 blocks of 16 tokens: two ~55-token prompts fit, not both once they grow 40 tokens
    small = {"kv_cache_memory": 9 * 8192, "max_model_len": 144}
    spec = job_dict(tiny_model, src, tmp_path / "out", engine=small)
    spec["sampling"].update(max_tokens=40, ignore_eos=True)
    shown: list = []  # the run's Progress: its last sample reads the executor's live counts
    report = run_job(spec, show_progress=False, on_progress=shown.append)
    assert report.status == "complete" and report.rows_ok == 4
    assert report.preemptions > 0
    assert shown[0].preemptions == report.preemptions and "rows preempted" in shown[0].line()
    assert json.loads((tmp_path / "out" / "report.json").read_text())["preemptions"] > 0
    assert f"preempted   {report.preemptions} times" in report.summary()
    assert "engine.kv_cache_memory" in report.summary()
    roomy = job_dict(tiny_model, src, tmp_path / "roomy", engine={"max_model_len": 144})
    roomy["sampling"].update(max_tokens=40, ignore_eos=True)
    assert run_job(roomy, show_progress=False).preemptions == 0


def test_a_kv_cache_with_no_room_for_blocks_names_the_setting(
    tiny_model: Path, tmp_path: Path
) -> None:
    """An audit: a kv_cache_memory too small for 2 blocks said "model.source '...' cannot be
    loaded": the model was fine; the key to change is engine.kv_cache_memory."""
    from tokenmill.jobs.spec import JobSpecError

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    spec = job_dict(tiny_model, src, tmp_path / "out", engine={"kv_cache_memory": 1_000})
    said = r"^engine.kv_cache_memory: expected room for at least 2 KV blocks of \d+ bytes"
    with pytest.raises(JobSpecError, match=said + r" \(it leaves room for 0: .*got 1000$"):
        run_job(spec, show_progress=False)


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_a_device_this_machine_lacks_names_the_setting(
    tiny_model: Path, tmp_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit: engine.device cuda without a GPU said "model.source '...' cannot be
    loaded" under a set model.dtype (the model was fine), and "engine.device: device=..."
    under auto; both now name engine.device and what it accepts here."""
    from tokenmill.jobs.spec import JobSpecError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    spec = job_dict(tiny_model, src, tmp_path / "out", engine={"device": "cuda"})
    spec["model"]["dtype"] = dtype
    said = r"^engine.device: expected cpu or auto \(no CUDA GPU is visible\), got 'cuda'$"
    with pytest.raises(JobSpecError, match=said):
        run_job(spec, show_progress=False)
    assert not (tmp_path / "out" / "shards").exists()


def test_a_cpu_kv_cache_larger_than_the_memory_available_is_refused_up_front(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 GB on a 24 GiB box failed the allocation after the model loaded (exit 1, "rerun to
    resume", with a traceback), and a fraction of 0.99 woke the out-of-memory killer: a
    fraction did not count the memory in use."""
    from tokenmill.engine import engine_config
    from tokenmill.engine.engine_config import EngineConfig
    from tokenmill.jobs.spec import JobSpecError

    gib = 1 << 30
    monkeypatch.setattr(engine_config, "host_memory", lambda: (8 * gib, 1 * gib))
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    spec = job_dict(tiny_model, src, tmp_path / "out", engine={"kv_cache_memory": 2 * gib})
    with pytest.raises(JobSpecError, match=r"engine.kv_cache_memory: expected at most the 1.0 "
                       r"GiB of host memory available now \(of 8.0 GiB\)"):  # fmt: skip
        run_job(spec, show_progress=False)
    cpu = torch.device("cpu")
    assert EngineConfig(model="m", kv_cache_memory=0.5).kv_cache_budget(cpu) == 4 * gib - 7 * gib
    assert EngineConfig(model="m", kv_cache_memory=0.95).kv_cache_budget(cpu, 1 << 20) == (
        int(0.95 * 8 * gib) - 7 * gib - (1 << 20)
    )
    assert EngineConfig(model="m", kv_cache_memory=gib // 2).kv_cache_budget(cpu) == gib // 2


def _cancelled_after(spec: dict, rows: int) -> JobReport:
    """Run ``spec``, cancelling it once ``rows`` rows have finished; its report."""
    from tokenmill.jobs.progress import Progress

    cancel = threading.Event()

    def watch(progress: Progress) -> None:
        def stop() -> None:
            while progress.done_this_run < rows and not cancel.is_set():
                time.sleep(0.001)
            cancel.set()

        threading.Thread(target=stop, daemon=True).start()

    return run_job(spec, cancel=cancel, show_progress=False, on_progress=watch)


def test_a_cancelled_run_reports_the_tokens_its_dropped_rows_generated(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A cancel drops the rows in flight: report.json counted only the finished rows' tokens
    (about a sixth of the engine's work), so the summary's rate was ~6x too low."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(64))
    spec = job_dict(tiny_model, src, tmp_path / "out", sampling={"max_tokens": 48,
                    "ignore_eos": True}, engine={"max_num_seqs": 16},
                    output={"rows_per_shard": 1000})  # fmt: skip
    report = _cancelled_after(spec, rows=16)
    assert report.status == "cancelled" and report.rows_this_run == 0
    generated = report.throughput_over_time[-1][1]
    assert report.completion_tokens == generated > 16 * 48  # the dropped rows' included
    # the finished rows not written (their shard was not complete) are said to be lost
    assert report.rows_not_committed >= 16 and "a rerun computes them again" in report.summary()


def test_a_cancelled_run_counts_only_the_copies_it_committed(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Copies for duplicates made before a cancel, in shards never committed, were counted in
    rows_deduplicated (649 with 0 rows committed): summed over runs, counted twice."""
    base = chat_rows(32)
    rows = [{**base[i % 32], "id": f"r{i}"} for i in range(64)]  # 32 duplicates
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    spec = job_dict(tiny_model, src, tmp_path / "out", output={"rows_per_shard": 1000},
                    sampling={"max_tokens": 48, "ignore_eos": True},
                    engine={"max_num_seqs": 4})  # fmt: skip
    report = _cancelled_after(spec, rows=8)
    assert report.status == "cancelled" and report.rows_this_run == 0
    assert (report.rows_deduplicated, report.deduplicated_tokens) == (0, 0)
    complete = run_job(spec, show_progress=False)
    assert complete.rows_deduplicated == 32 and complete.rows_this_run == 64


def test_changed_fingerprint_refuses_to_resume_unless_fresh(
    tiny_model: Path, tmp_path: Path
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    out = tmp_path / "out"
    run_job(job_dict(tiny_model, src, out), show_progress=False)
    changed = job_dict(tiny_model, src, out, sampling={"max_tokens": 5})
    with pytest.raises(FingerprintMismatchError, match="--fresh"):
        run_job(changed, show_progress=False)
    report = run_job(changed, fresh=True, show_progress=False)
    assert report.status == "complete" and report.rows_this_run == 6
    ok, _ = _outputs(out)
    assert len(ok) == 6 and all(r["completion_tokens"] <= 5 for r in ok)


def test_job_under_the_old_prefix_caching_key_resumes_under_the_new_one(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A job.yaml from before the rename still runs, and its output resumes after the key is
    renamed: the fingerprint does not depend on the spelling."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    out = tmp_path / "out"
    old_spec = job_dict(tiny_model, src, out, engine={"prefix_caching": False})
    old = run_job(old_spec, show_progress=False)
    assert old.status == "complete" and old.prefix_cache_hit_rate == 0.0
    new = job_dict(tiny_model, src, out, engine={"enable_prefix_caching": False})
    again = run_job(new, show_progress=False)
    assert again.status == "complete" and again.rows_this_run == 0 and again.rows_ok == 6


def test_parquet_in_and_out(tiny_model: Path, tmp_path: Path) -> None:
    rows = chat_rows(7)
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, output={"format": "parquet", "rows_per_shard": 3})
    report = run_job(spec, show_progress=False)
    assert report.status == "complete" and report.shards_committed == 3
    table = pa.concat_tables(pq.read_table(p) for p in sorted((out / "shards").glob("*.parquet")))
    assert sorted(table.column("id").to_pylist()) == [r["id"] for r in rows]
    assert set(table.column_names) >= {"id", "text", "finish_reason", "topic"}


def test_local_greedy_output_is_deterministic(tiny_model: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(9))
    texts = []
    for name in ("a", "b"):
        spec = job_dict(
            tiny_model, src, tmp_path / name, engine={"max_num_seqs": 3 if name == "a" else 8}
        )
        run_job(spec, show_progress=False)
        ok, _ = _outputs(tmp_path / name)
        texts.append({r["id"]: r["text"] for r in ok})
    assert texts[0] == texts[1]


def test_async_scheduling_job_matches_the_plain_loop(tiny_model: Path, tmp_path: Path) -> None:
    """On a GPU jobs run with async scheduling: the job path (rows in flight, results a step
    later) must write the same rows as with the plain loop, stop strings included."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(12))
    probe = tmp_path / "probe"
    run_job(job_dict(tiny_model, src, probe, sampling={"max_tokens": 20}), show_progress=False)
    texts = [r["text"] for r in _outputs(probe)[0]]
    # A character some but not all rows produce: those rows stop early, the rest run out.
    stop = max(
        (c for c in set("".join(texts)) if sum(c in t for t in texts) < len(texts)),
        key=lambda c: sum(c in t for t in texts),
    )
    rows = {}
    for mode in (False, True):
        spec = job_dict(
            tiny_model,
            src,
            tmp_path / str(mode),
            sampling={"max_tokens": 20, "stop": [stop]},
            engine={"max_num_seqs": 5, "async_scheduling": mode},
        )
        assert run_job(spec, show_progress=False).status == "complete"
        ok, _ = _outputs(tmp_path / str(mode))
        rows[mode] = {r["id"]: (r["text"], r["finish_reason"]) for r in ok}
    assert rows[True] == rows[False] and len(rows[True]) == 12
    assert {reason for _, reason in rows[True].values()} >= {"stop", "length"}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "async"])
def test_submit_cancel_then_resume(tiny_model: Path, tmp_path: Path, async_scheduling) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(120))
    ref_out, out = tmp_path / "ref", tmp_path / "out"
    run_job(job_dict(tiny_model, src, ref_out, sampling={"max_tokens": 16}), show_progress=False)
    engine = {"max_num_seqs": 2, "async_scheduling": async_scheduling}
    spec = job_dict(tiny_model, src, out, sampling={"max_tokens": 16}, engine=engine)
    handle = submit(spec)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if committed_shards(out):
            break
        time.sleep(0.02)
    seen = handle.progress()  # the numbers of the progress line, while it runs
    assert seen is not None and seen.rows_total == 120 and 0 < seen.rows_done < 120
    handle.cancel()
    assert handle.wait(60)
    first = handle.result()
    assert first.status == "cancelled" and 0 < first.rows_this_run < 120
    assert first.rows_total == 120  # the input's rows, not the rows committed so far
    final = handle.progress()
    assert final.rows_done >= first.rows_this_run and final.output_tokens > 0
    resumed = submit(spec).result(120)
    assert resumed.status == "complete" and resumed.rows_resumed == first.rows_this_run
    ok, _ = _outputs(out)
    ref, _ = _outputs(ref_out)
    assert len(ok) == 120
    assert {r["id"]: r["text"] for r in ok} == {r["id"]: r["text"] for r in ref}


def _fail_after(monkeypatch: pytest.MonkeyPatch, results: int) -> None:
    """Make a run raise once its shard tracker has taken ``results`` results."""
    from tokenmill.jobs.shard_tracker import ShardTracker

    add, taken = ShardTracker.add_result, [0]

    def add_until(self, result):
        taken[0] += 1
        if taken[0] > results:
            raise RuntimeError(f"injected failure after {results} results")
        return add(self, result)

    monkeypatch.setattr(ShardTracker, "add_result", add_until)


def test_reports_count_the_rows_earlier_runs_committed_whatever_this_run_reached(
    tiny_model: Path, tmp_path: Path, monkeypatch
) -> None:
    """A review: a failed run, and a resumed one cancelled before generation, said
    rows_resumed 0 beside rows_ok 12 (the rows its reader had skipped, not those earlier
    runs committed); a failed run wrote no report.html, so the page of the run before stayed
    ("cancelled", its own counts) beside a report.json saying "failed"."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(40))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out)
    _fail_after(monkeypatch, 10)
    with pytest.raises(RuntimeError, match="injected"):
        run_job(spec, show_progress=False)
    first = json.loads((out / "report.json").read_text())
    done = first["rows_ok"] + first["rows_failed"]
    assert first["status"] == "failed" and done > 0 and first["rows_resumed"] == 0
    # 10 rows had results, the whole shards of them committed: the rest a rerun makes again
    assert first["rows_not_committed"] == 10 - done > 0
    page = (out / "report.html").read_text()
    assert "tokenmill job test: failed" in page
    _fail_after(monkeypatch, 9)
    with pytest.raises(RuntimeError, match="injected"):
        run_job(spec, show_progress=False)
    second = json.loads((out / "report.json").read_text())
    assert second["status"] == "failed" and second["rows_resumed"] == done
    monkeypatch.undo()
    handle = submit(spec)
    handle.cancel()  # before generation (or early in it)
    cancelled = handle.result(60)
    committed = second["rows_ok"] + second["rows_failed"]
    assert cancelled.rows_resumed == committed
    assert cancelled.rows_ok + cancelled.rows_failed == committed + cancelled.rows_this_run
    final = run_job(spec, show_progress=False)
    assert final.status == "complete" and final.rows_resumed + final.rows_this_run == 40


def _slow_model_load(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make a run's model load take 0.5 s more; the event is set once it has begun."""
    from tokenmill.jobs import runner

    load, loading = runner._load_executor, threading.Event()

    def slow_load(*args, **kwargs):
        loading.set()
        time.sleep(0.5)
        return load(*args, **kwargs)

    monkeypatch.setattr(runner, "_load_executor", slow_load)
    return loading


def test_a_job_cancelled_before_generation_shows_no_progress(
    tiny_model: Path, tmp_path: Path, monkeypatch
) -> None:
    """Cancelled while its model loads: generation never started, so progress() stays None
    as README says (it gave a snapshot of an unfinished run that never ran)."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(20))
    loading = _slow_model_load(monkeypatch)
    handle = submit(job_dict(tiny_model, src, tmp_path / "out"))
    assert loading.wait(30)
    handle.cancel()
    assert handle.result(60).status == "cancelled" and handle.progress() is None


def test_a_job_cancelled_before_its_input_is_counted_reports_no_total(
    tiny_model: Path, tmp_path: Path, monkeypatch
) -> None:
    """Cancelled while its model loads and its input is still being counted: the count
    stops with the run (it went on to the end of the input: 26 s for 5,000 files on S3),
    and report.json says the input's rows are not known (null), where it said 0 (the rows
    committed so far, read as the input's size)."""
    from tokenmill.jobs import runner

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(20))
    loading = _slow_model_load(monkeypatch)

    def slow_count(cfg, stop=None):
        assert stop is not None and stop.wait(30), "the count was not stopped"
        return None  # as input_row_total does once stopped

    monkeypatch.setattr(runner, "input_row_total", slow_count)
    handle = submit(job_dict(tiny_model, src, tmp_path / "out"))
    assert loading.wait(30)
    handle.cancel()
    report = handle.result(20)
    assert report.status == "cancelled" and report.rows_total is None
    assert json.loads((tmp_path / "out" / "report.json").read_text())["rows_total"] is None
    assert "job " in report.summary()
    assert "not counted" in (tmp_path / "out" / "report.html").read_text()


def test_the_first_rows_never_wait_for_the_input_count(
    tiny_model: Path, tmp_path: Path, monkeypatch
) -> None:
    """A count that has not ended (a large input on S3 took 26 s) holds no row back: the
    job commits rows, and completes, while it still runs; the total comes when it ends,
    and the count is stopped with the job."""
    from tokenmill.jobs import runner
    from tokenmill.jobs.row_estimate import RowTotal

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(20))
    release, counting, stopped = threading.Event(), threading.Event(), threading.Event()

    def slow_count(cfg, stop=None):
        counting.set()
        while not release.wait(0.05):
            if stop is not None and stop.is_set():
                stopped.set()
                return None
        return RowTotal(20, estimated=False)

    monkeypatch.setattr(runner, "input_row_total", slow_count)
    handle = submit(job_dict(tiny_model, src, tmp_path / "out", output={"rows_per_shard": 5}))
    try:
        report = handle.result(30)  # (a job that waited for the count timed out here)
    finally:
        release.set()
    assert counting.is_set() and stopped.wait(5), "the count ran on past the job"
    assert report.status == "complete" and report.rows_ok == 20
    assert report.rows_total == 20  # (a complete job's: the rows read, the count never ended)


def test_ctrl_c_while_waiting_on_a_handle_stops_the_job_at_a_boundary(
    tiny_model: Path, tmp_path: Path, monkeypatch
) -> None:
    """Ctrl-C in result(): the job stops at its next commit boundary (as run-job does) and
    the handle says so: it said "failed", result() hit an assert and the job ran on, to be
    killed mid-write when the interpreter exited."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(120))
    out = tmp_path / "out"
    engine = {"max_num_seqs": 2}
    handle = submit(job_dict(tiny_model, src, out, sampling={"max_tokens": 16}, engine=engine))
    wait = handle._done.wait
    interrupted = []

    def ctrl_c_once(timeout=None):
        if not interrupted and not committed_shards(out):
            time.sleep(0.02)
            return wait(0)  # not yet: the job has no shard committed
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return wait(timeout)

    monkeypatch.setattr(handle._done, "wait", ctrl_c_once)
    with pytest.raises(KeyboardInterrupt):
        while not handle.wait(60):
            pass
    assert handle.status() == "cancelled" and not handle._thread.is_alive()
    report = handle.result()
    assert report.status == "cancelled" and 0 < report.rows_this_run < 120


def test_a_cancel_once_every_row_is_done_leaves_the_job_complete(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A cancel that lands after the last row was committed changed nothing, yet the run
    read "cancelled", and the rerun loaded the model again to find nothing to do."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(9))
    out = tmp_path / "out"

    class LateCancel(threading.Event):
        def is_set(self) -> bool:  # set once the input has every row committed
            return sum(s["end_row"] - s["first_row"] for s in committed_shards(out).values()) == 9

    report = run_job(job_dict(tiny_model, src, out), cancel=LateCancel(), show_progress=False)
    assert (report.status, report.rows_ok, report.rows_total) == ("complete", 9, 9)
    again = run_job(job_dict(tiny_model, src, out), show_progress=False)
    assert again.status == "complete" and again.rows_this_run == 0


def test_a_failed_handles_error_keeps_its_traceback(tmp_path: Path) -> None:
    """Each result() raised the one stored error again, its traceback two frames longer."""
    import traceback

    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    handle = submit(job_dict(tmp_path / "no-model", src, tmp_path / "out"))
    lengths = []
    for _ in range(3):
        with pytest.raises(Exception) as caught:
            handle.result(60)
        lengths.append(len(traceback.extract_tb(caught.value.__traceback__)))
    assert lengths[0] == lengths[1] == lengths[2], lengths


def test_a_handle_says_run_jobs_exit_code_for_how_its_job_ended(
    tiny_model: Path, tmp_path: Path, monkeypatch
) -> None:
    """An audit: a program holding handles could not tell "fix the spec" (2) from "retry
    later" (75) from "failed" (1) without run-job's private checks: a settings change and a
    locked output raised RuntimeErrors both, a file gone mid-run and a full disk OSErrors
    both. exit_code() says what run-job exits with, the same for the same job."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(120))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, sampling={"max_tokens": 16}, engine={"max_num_seqs": 2})
    running = submit(spec)
    assert running.exit_code() is None  # still running
    deadline = time.monotonic() + 60
    while not committed_shards(out) and time.monotonic() < deadline:
        time.sleep(0.02)
    locked = submit(spec)  # the same output while the first writes it: retry later
    with pytest.raises(RuntimeError):
        locked.result(60)
    assert locked.exit_code() == 75
    running.cancel()
    assert running.result(60).status == "cancelled" and running.exit_code() == 75
    changed = job_dict(tiny_model, src, out, sampling={"max_tokens": 3})
    other_settings = submit(changed)  # progress made with other settings: fix it first
    with pytest.raises(FingerprintMismatchError):
        other_settings.result(60)
    job = tmp_path / "changed.json"
    job.write_text(json.dumps(changed))
    assert other_settings.exit_code() == cli_main([str(job), "--quiet"]) == 2
    _fail_after(monkeypatch, 3)
    failed = submit(spec)
    with pytest.raises(RuntimeError, match="injected"):
        failed.result(60)
    assert failed.exit_code() == 1
    monkeypatch.undo()
    done = submit(spec)
    assert done.result(60).status == "complete" and done.exit_code() == 0
    no_model = submit(job_dict(tmp_path / "no-model", src, tmp_path / "out2"))
    with pytest.raises(ValueError):
        no_model.result(60)
    assert no_model.exit_code() == 2


def test_a_process_exiting_with_a_job_running_stops_it_at_a_commit_boundary(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A script that returned while a submit()ted job ran aborted (SIGABRT, "terminate called
    without an active exception": the engine taken down mid-step) and wrote no report."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(300))
    long_rows = {"max_tokens": 128, "temperature": 0.0, "ignore_eos": True}
    spec = job_dict(tiny_model, src, tmp_path / "out", sampling=long_rows)
    job = tmp_path / "job.json"
    job.write_text(json.dumps(spec))
    script = (
        "import json, time, tokenmill\n"
        f"handle = tokenmill.submit(json.load(open({str(job)!r})))\n"
        "while handle.progress() is None and handle.status() == 'running':\n"
        "    time.sleep(0.05)\n"
        "assert handle.status() == 'running', handle.status()\n"
    )  # and returns, the job still running
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exiting with 1 tokenmill job(s) still running (test)" in done.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "cancelled" and report["rows_ok"] < 300
    again = run_job(spec, show_progress=False)
    assert (again.status, again.rows_ok, again.rows_resumed) == ("complete", 300, report["rows_ok"])


def test_a_forked_child_exits_without_waiting_for_its_parents_jobs(
    tiny_model: Path, tmp_path: Path
) -> None:
    """An audit: a child forked while a submit()ted job ran inherited the running handles,
    and its exit warned of a job "still running" and waited forever for it (no thread of
    its ran it)."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(300))
    long_rows = {"max_tokens": 128, "temperature": 0.0, "ignore_eos": True}
    job = tmp_path / "job.json"
    job.write_text(json.dumps(job_dict(tiny_model, src, tmp_path / "out", sampling=long_rows)))
    script = (
        "import json, os, sys, time, tokenmill\n"
        f"handle = tokenmill.submit(json.load(open({str(job)!r})))\n"
        "while handle.progress() is None and handle.status() == 'running':\n"
        "    time.sleep(0.05)\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    sys.exit(0)  # a normal exit: atexit handlers run\n"
        "deadline = time.monotonic() + 60\n"
        "while os.waitpid(child, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print('child gone' if time.monotonic() < deadline else 'child hung', flush=True)\n"
        "handle.cancel()\n"
        "handle.wait()\n"
        "if time.monotonic() >= deadline:\n"
        "    os.kill(child, 9)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "child gone", done.stderr[-2000:]
    assert "still running" not in done.stderr


def test_a_run_failing_before_it_generates_closes_its_engine(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit: an on_progress callback that raised failed the run before the block that
    closes the engine, which then lived (KV cache and all) as long as the exception did:
    +260 MB a failed run kept by retry code."""
    from tokenmill.jobs.local_executor import RowProcessor

    closed: list[bool] = []
    close = RowProcessor.close
    monkeypatch.setattr(RowProcessor, "close", lambda self: closed.append(True) or close(self))
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))

    def broken(progress: object) -> None:
        raise ValueError("the callback's own bug")

    with pytest.raises(ValueError, match="callback's own bug"):
        run_job(job_dict(tiny_model, src, tmp_path / "out"), show_progress=False,
                on_progress=broken)  # fmt: skip
    assert closed == [True]
    assert run_job(job_dict(tiny_model, src, tmp_path / "out"), show_progress=False).rows_ok == 3


def test_a_full_disk_under_stdout_does_not_fail_a_complete_job(
    tiny_model: Path, tmp_path: Path
) -> None:
    """An audit: cron's ``run-job job.yaml >> nightly.log`` with the log's disk full: the
    complete job exited 75, "storage error ... rerun the same command", which cannot help."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    job = tmp_path / "job.json"
    job.write_text(json.dumps(job_dict(tiny_model, src, tmp_path / "out")))
    probe = (
        f"from tokenmill.jobs.cli import entry; import sys; sys.argv[1:] = [{str(job)!r}]; entry()"
    )
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "storage error" not in done.stderr
    assert json.loads((tmp_path / "out" / "report.json").read_text())["status"] == "complete"


def test_a_reader_gone_from_stdout_does_not_fail_a_complete_job(
    tiny_model: Path, tmp_path: Path
) -> None:
    """``run-job ... | head -0``: printing the summary hits a closed pipe once the job is
    complete; the exit code is still 0, not a storage error's 75."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    job = tmp_path / "job.json"
    job.write_text(json.dumps(job_dict(tiny_model, src, tmp_path / "out")))
    read, write = os.pipe()
    os.close(read)
    probe = (
        f"from tokenmill.jobs.cli import entry; import sys; sys.argv[1:] = [{str(job)!r}]; entry()"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], cwd=ROOT, stdout=write, stderr=subprocess.PIPE,
            text=True, timeout=300,
        )  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "storage error" not in done.stderr and "Traceback" not in done.stderr
    assert json.loads((tmp_path / "out" / "report.json").read_text())["status"] == "complete"


def test_cli_exit_codes(tiny_model: Path, tmp_path: Path, capsys) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(3))
    out = tmp_path / "out"
    job = tmp_path / "job.yaml"
    spec = job_dict(tiny_model, src, out)
    spec["engine"]["warp_speed"] = 9
    import yaml

    job.write_text(yaml.safe_dump(spec))
    assert cli_main([str(job)]) == 2
    err = capsys.readouterr().err
    assert "engine.warp_speed: unknown key" in err and str(job) in err

    del spec["engine"]["warp_speed"]
    job.write_text(yaml.safe_dump(spec))
    assert cli_main([str(job), "--set", "sampling.temperature=hot"]) == 2

    out.mkdir()
    with JobLock("test", str(out), str(out)):
        assert cli_main([str(job), "--quiet"]) == 75
    assert not (out / "shards").exists() and not (out / "test.manifest.json").exists()

    assert cli_main([str(job), "--quiet"]) == 0
    assert "complete" in capsys.readouterr().out
    assert cli_main([str(job), "--dry-run"]) == 0
    assert "already done    0 rows" not in capsys.readouterr().out
    assert cli_main([str(job), "--dry-run", "--fresh"]) == 0  # counts what --fresh runs
    assert "already done    0 rows" in capsys.readouterr().out


def test_dry_run_reports_and_writes_nothing(tiny_model: Path, tmp_path: Path, capsys) -> None:
    rows = chat_rows(6)
    for r in rows:  # a long shared system prompt: most prompt tokens are shared prefixes
        r["messages"].insert(0, {"role": "system", "content": "You are terse. " * 20})
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps(r) for r in rows] + BAD_LINES[:2])
    out = tmp_path / "out"
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tiny_model, src, out)))
    assert cli_main([str(job), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "rows            8 (2 bad)" in text
    share = float(text.split("shared prefixes")[1].split("%")[0])
    assert share > 50
    assert not out.exists()


def test_an_object_store_output_is_locked_whatever_its_spelling(tmp_path: Path) -> None:
    """A run on s3a://b/out holds the lock a run on s3://b/out/ asks for (Spark users spell
    S3 s3a://): the second start exits 75 instead of writing the same output at once."""
    pytest.importorskip("s3fs")
    from tokenmill.jobs.lock import JobLockedError
    from tokenmill.jobs.runner import open_output
    from tokenmill.jobs.spec import coerce_spec

    options = {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"}

    def lock_of(url: str) -> JobLock:
        spec = job_dict(tmp_path / "m", tmp_path / "in.jsonl", url)
        spec["output"]["storage_options"] = options
        return open_output(coerce_spec(spec))[1]

    first, second = (
        lock_of(f"s3a://bkt-{tmp_path.name}/out"),
        lock_of(f"s3://bkt-{tmp_path.name}/out/"),
    )
    assert first.path == second.path
    with first, pytest.raises(JobLockedError, match="is being written by job") as info:
        second.acquire()
    # the holder is this process: said so (it said to wait for "that process" to exit)
    assert "in this process (another submit()" in str(info.value)
    assert info.value.holder_job == "test"
    second.acquire()  # once released, it is free
    second.release()
    assert not second.path.exists()  # (an audit: one was left in ~/.cache for every output)


def test_a_lock_this_process_holds_unregistered_is_still_said_to_be_its(tmp_path: Path) -> None:
    """Between a run's flock and its entry among this process's locks (or as it releases),
    another run of this process was told "held by another run ... pid <its own>"."""
    import fcntl

    from tokenmill.jobs.lock import LOCK_FILE, JobLockedError

    (tmp_path / "out").mkdir()
    path = tmp_path / "out" / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a run that has not registered yet
        os.write(fd, f"job 'first', pid {os.getpid()} on here".encode())
        lock = JobLock("second", str(tmp_path / "out"), str(tmp_path / "out"))
        with pytest.raises(JobLockedError, match="being written by job 'first' in this process"):
            lock.acquire()
    finally:
        os.close(fd)


def _lock_holder(job: str, output: Path) -> subprocess.Popen:
    """A process that takes ``output``'s lock as ``job``, prints "held", and keeps the lock
    until its stdin closes."""
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; from tokenmill.jobs.lock import JobLock; "
         f"lock = JobLock({job!r}, 'out', {str(output)!r}); lock.acquire(); "
         "print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip


def test_a_lock_held_by_another_process_names_it(tmp_path: Path) -> None:
    from tokenmill.jobs.lock import JobLockedError

    holder = _lock_holder("other", tmp_path)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(JobLockedError, match="is held by another run") as info:
            JobLock("test", "out", str(tmp_path)).acquire()
        assert f"job 'other', pid {holder.pid}" in str(info.value)
        assert info.value.holder_job == "other"
    finally:
        holder.communicate("")


def test_a_lock_held_by_a_stopped_process_says_so_and_how_to_resume_it(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An audit: a run stopped (Ctrl-Z, SIGSTOP) while it held the lock made every cron start
    exit 75 saying only "rerun when it has finished". The refusal, on stderr with --quiet
    too, now names the holder's pid, host and start, says it is stopped and how to resume
    or end it; the exit code stays 75 (README: another run holds the output)."""
    import signal

    import yaml

    from tokenmill.jobs.lock import JobLockedError

    out = tmp_path / "out"
    out.mkdir()

    holder = _lock_holder("test", out)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(JobLockedError) as running:
            JobLock("test", "out", str(out)).acquire()
        assert f"pid {holder.pid} on {os.uname().nodename}, since " in str(running.value)
        assert not running.value.holder_stopped and "is stopped" not in str(running.value)
        os.kill(holder.pid, signal.SIGSTOP)
        stat = Path(f"/proc/{holder.pid}/stat")
        for _ in range(200):  # (the signal lands a moment after kill() returns)
            if stat.read_text().rpartition(")")[2].split()[0] == "T":
                break
            time.sleep(0.01)
        with pytest.raises(JobLockedError) as stopped:
            JobLock("test", "out", str(out)).acquire()
        said = str(stopped.value)
        assert f"job 'test', pid {holder.pid} on {os.uname().nodename}, since " in said
        assert f"Process {holder.pid} is stopped (state T in /proc/{holder.pid}/stat" in said
        assert f"`kill -CONT {holder.pid}`" in said and f"`kill {holder.pid}`" in said
        assert stopped.value.holder_pid == holder.pid and stopped.value.holder_job == "test"
        # run-job: exit 75, the message on stderr under --quiet (cron's log), none on stdout
        src = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump(job_dict(tiny_model, src, out)))
        capsys.readouterr()
        assert cli_main([str(job), "--quiet"]) == 75
        out, err = capsys.readouterr()
        assert f"Process {holder.pid} is stopped" in err and f"kill -CONT {holder.pid}" in err
        assert out == ""
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.communicate("")


def test_a_holder_in_a_frozen_cgroup_is_said_to_be_frozen(tmp_path: Path) -> None:
    """A frozen cgroup's tasks show state S or D, not T: only the cgroup says they are."""
    from tokenmill.jobs.process_state import stopped_how

    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "stat").write_text("42 (python3 (x)) S 1 42 42 0")
    (proc / "42" / "cgroup").write_text("0::/jobs/nightly\n")
    (cgroups / "jobs" / "nightly").mkdir(parents=True)
    events = cgroups / "jobs" / "nightly" / "cgroup.events"
    events.write_text("populated 1\nfrozen 0\n")
    assert stopped_how(42, proc, cgroups) is None
    events.write_text("populated 1\nfrozen 1\n")
    stopped = stopped_how(42, proc, cgroups)
    assert stopped is not None and "frozen cgroup" in stopped.how
    assert f"echo 0 > {cgroups / 'jobs' / 'nightly' / 'cgroup.freeze'}" in stopped.resume


def test_a_forked_child_holds_none_of_its_parents_locks(tmp_path: Path) -> None:
    """A review: a forked child was told the output was "being written by job 'A' in this
    process" (its parent's)."""
    from tokenmill.jobs import lock

    held = JobLock("A", "out", str(tmp_path))
    held.acquire()
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: what it believes it holds
            os.write(write, str(len(lock._HELD)).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 16) == b"0" and len(lock._HELD) == 1
    finally:
        held.release()
    assert lock._HELD == {}


def test_a_forked_child_outliving_its_parent_does_not_keep_its_lock(tmp_path: Path) -> None:
    """An audit: a flock belongs to the open file, which a forked child shares, so a child of
    a run's process (a fork-started worker) that outlived it kept the dead run's lock, and
    every later run was refused, told to wait for the dead pid.

    The child lets go of its copy in its fork hook, which runs before ``fork()`` returns in
    the child, so the lock is looked at once the child says it runs. Looked at when only the
    parent had exited, it was held now and then: on a loaded box the child was not yet
    scheduled, its hook not yet run (2 runs in 30 under a CPU hog). A hook registered before
    the lock's makes the child that slow in every run."""
    from tokenmill.jobs.lock import JobLockedError

    program = (
        "import os, sys, time; os.register_at_fork(after_in_child=lambda: time.sleep(0.2))\n"
        "from tokenmill.jobs.lock import JobLock\n"
        f"JobLock('A', 'out', {str(tmp_path)!r}).acquire(); pid = os.fork()\n"
        "if pid == 0: print('child', flush=True); sys.stdin.read(); os._exit(0)\n"  # lives on
        "print(pid, flush=True); os._exit(0)"  # the run dies without releasing
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip
    lines = {parent.stdout.readline().strip() for _ in range(2)}  # either may come first
    assert "child" in lines, lines
    child = int((lines - {"child"}).pop())
    try:
        assert parent.wait(30) == 0
        lock = JobLock("B", "out", str(tmp_path))
        try:
            lock.acquire()
        except JobLockedError as exc:
            pytest.fail(f"the dead run's child kept its lock: {exc}")
        lock.release()
    finally:
        parent.stdin.close()  # the child reads EOF and exits
        for _ in range(500):
            if not Path(f"/proc/{child}").exists():
                break
            time.sleep(0.01)


@pytest.mark.parametrize("store", ["local", "object store"])
def test_releasing_a_lock_whose_file_was_replaced_leaves_the_new_holders_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str
) -> None:
    """An audit: run A's lock file was removed as A ran (a cache cleaner, a person) and run
    B locked a new one; A's release then unlinked B's file by its path (or raised on a
    file already gone), and run C locked a third file and wrote beside B."""
    from tokenmill.jobs.lock import JobLockedError

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    local = None if store == "object store" else str(out)
    a, b, c = (JobLock(name, "s3://b/out", local) for name in "ABC")
    a.acquire()
    a.path.unlink()  # removed under A
    b.acquire()
    try:
        a.release()  # not B's file: left alone
        assert b.path.exists()
        with pytest.raises(JobLockedError, match="job 'B'"):
            c.acquire()
    finally:
        b.release()
    a.acquire()  # the file gone before release is no error either
    a.path.unlink()
    a.release()


def test_a_job_that_fails_mid_run_shows_no_rows_in_flight(
    tiny_model: Path, tmp_path: Path, monkeypatch
) -> None:
    """A review: the Progress of a run whose executor raised was left running: its snapshot
    kept rows in flight and an ETA after the job had failed."""
    from tokenmill.jobs import runner

    load = runner._load_executor

    def failing_load(*args, **kwargs):
        executor = load(*args, **kwargs)
        process = executor.process

        def dies_after_three(feed, cancel, tick):
            for i, result in enumerate(process(feed, cancel, tick)):
                yield result
                if i == 2:
                    time.sleep(1.1)  # a progress sample (one a second) counts rows in flight
                    tick()
                    raise RuntimeError("replica died")

        executor.process = dies_after_three
        return executor

    monkeypatch.setattr(runner, "_load_executor", failing_load)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(20))
    handle = submit(job_dict(tiny_model, src, tmp_path / "out"))
    with pytest.raises(RuntimeError, match="replica died"):
        handle.result(120)
    seen = handle.progress()
    assert seen is not None and seen.rows_in_flight == 0 and seen.eta_seconds is None


def test_a_lock_file_taken_away_as_it_is_locked_is_locked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit: run B opened the lock file, then its holder A released it, taking the file
    (and the folder it made) away because A wrote nothing; run C took a new lock file; B
    then locked the old, unlinked one and both B and C went on to write the output."""
    from tokenmill.jobs import lock as lock_module
    from tokenmill.jobs.lock import JobLockedError

    out = tmp_path / "out"
    a, b, c = (JobLock(name, str(out), str(out)) for name in "ABC")
    a.acquire()
    real_open = os.open
    raced = []

    def open_then_race(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        if not raced:  # B has the file open and has not locked it yet
            raced.append(True)
            a.release()  # the output holds nothing else: the file and folder go
            assert not out.exists()
            c.acquire()
        return fd

    monkeypatch.setattr(lock_module.os, "open", open_then_race)
    try:
        with pytest.raises(JobLockedError, match="being written by job 'C'"):
            b.acquire()
    finally:
        c.release()
    b.acquire()  # once C is done, B takes it
    b.release()
