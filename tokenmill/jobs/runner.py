"""The job runner: spec in, committed shards and a report out, resumable at any moment.

lock ─► manifest (fingerprint check) ─► reader ─► skip committed shards ─► executor
    ─► shard tracker ─► commit data + error files ─► manifest ─► report.json
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from tokenmill.engine.loader import resolve_model_source
from tokenmill.io.readers import InputConfig, input_fingerprint, iter_input_rows
from tokenmill.io.rows import InputRow
from tokenmill.io.storage import OutputStore
from tokenmill.io.writers import encode_errors, encode_results, shard_names
from tokenmill.jobs.fingerprint import job_fingerprint
from tokenmill.jobs.lock import JobLock
from tokenmill.jobs.manifest import Manifest, ShardRecord
from tokenmill.jobs.progress import Progress
from tokenmill.jobs.report import JobReport
from tokenmill.jobs.requests import error_result
from tokenmill.jobs.row_count import count_input_rows
from tokenmill.jobs.shard_tracker import ShardTracker
from tokenmill.jobs.spec import JobSpec, coerce_spec

log = logging.getLogger("tokenmill.jobs")
REPORT_NAME = "report.json"


def input_config(spec: JobSpec) -> InputConfig:
    i = spec.input
    return InputConfig(
        path=i.path,
        format=i.format,
        id_column=i.id_column,
        prompt_column=i.prompt_column,
        messages_column=i.messages_column,
        passthrough_columns=tuple(i.passthrough_columns),
        storage_options=dict(i.storage_options),
    )


def open_output(spec: JobSpec) -> tuple[OutputStore, JobLock]:
    store = OutputStore(spec.output.path, dict(spec.output.storage_options))
    local_dir = store.root if store.is_local else None
    return store, JobLock(spec.name, store.url, local_dir)


def fingerprint_of(spec: JobSpec) -> str:
    source = resolve_model_source(spec.model.source)
    return job_fingerprint(
        spec, source.path, source.chat_template(), input_fingerprint(input_config(spec))
    )


def run_job(
    spec: JobSpec | str | os.PathLike | dict[str, Any],
    *,
    fresh: bool = False,
    cancel: threading.Event | None = None,
    show_progress: bool = True,
) -> JobReport:
    """Run (or resume) the job to completion. Raises JobLockedError when another run holds
    the job, FingerprintMismatchError when the output holds another configuration's progress
    (unless ``fresh``); per-row problems never raise, they go to the error files.
    ``spec`` may be a JobSpec, a path to a job.yaml or a dict of sections."""
    spec = coerce_spec(spec)
    store, lock = open_output(spec)
    with lock:
        return _run_locked(spec, store, fresh, cancel or threading.Event(), show_progress)


def _run_locked(
    spec: JobSpec, store: OutputStore, fresh: bool, cancel: threading.Event, show_progress: bool
) -> JobReport:
    start = time.monotonic()
    report = JobReport(job=spec.name, output=store.url, executor=spec.execution.executor)
    fingerprint = fingerprint_of(spec)
    manifest = Manifest.load(store, spec.name)
    if manifest is not None and fresh:
        _discard(store, manifest)
        manifest = None
    if manifest is not None:
        manifest.check_fingerprint(fingerprint, store.url)
    if manifest is None:
        manifest = Manifest(spec.name, fingerprint, spec.output.rows_per_shard)
        manifest.save(store)
    removed = store.cleanup_temp()
    if removed:
        log.info("removed %d temporary files left by an interrupted run", removed)

    if manifest.complete:
        _fill_totals(report, manifest)
        report.status = "complete"
        log.info("job %s is already complete; nothing to do", spec.name)
        return report

    total = count_input_rows(input_config(spec))
    executor = _make_executor(spec, total)  # loads the model: not part of the rate
    progress = Progress(total, manifest.rows_done, enabled=show_progress)
    feed = _Feed(spec, manifest, progress)
    fmt = spec.output.format
    try:
        for result in executor.process(feed.rows(), cancel):
            feed.tracker.add_result(result)
            report.prompt_tokens += result.prompt_tokens
            report.completion_tokens += result.completion_tokens
            progress.update(1, result.completion_tokens)
            _commit_ready(store, manifest, feed, report, fmt)
        _commit_ready(store, manifest, feed, report, fmt)
    finally:
        progress.close()
        report.wall_seconds = round(time.monotonic() - start, 3)
        report.throughput_over_time = progress.samples
        queried, hits = executor.prefix_stats
        report.prefix_cache_hit_rate = round(hits / queried, 4) if queried else 0.0
        executor.close()

    if cancel.is_set():
        report.status = "cancelled"
    else:
        if feed.tracker.num_pending_rows:
            raise RuntimeError(
                f"{feed.tracker.num_pending_rows} rows got no result; "
                "the job is incomplete (rerun to resume)"
            )
        manifest.complete = True
        manifest.total_rows = feed.rows_read
        manifest.save(store)
        report.status = "complete"
    report.rows_resumed = feed.rows_resumed
    _fill_totals(report, manifest)
    store.write_atomic(REPORT_NAME, report.to_json().encode())
    return report


class _Feed:
    """Streams the input, skipping committed shards; bad rows become results at once."""

    def __init__(self, spec: JobSpec, manifest: Manifest, progress: Progress) -> None:
        self.cfg = input_config(spec)
        self.manifest = manifest
        self.model = spec.model.source
        self.progress = progress
        self.tracker = ShardTracker(spec.output.rows_per_shard)
        self.rows_read = 0
        self.rows_resumed = 0

    def rows(self) -> Iterator[InputRow]:
        for row in iter_input_rows(self.cfg):
            self.rows_read += 1
            if self.tracker.shard_of(row.row_index) in self.manifest.shards:
                self.rows_resumed += 1
                continue
            self.tracker.row_seen(row.row_index)
            if row.error is not None:
                self.tracker.add_result(error_result(row, row.error, self.model))
                self.progress.update(1, 0)
                continue
            yield row
        self.tracker.input_done()


def _commit_ready(
    store: OutputStore, manifest: Manifest, feed: _Feed, report: JobReport, fmt: str
) -> None:
    """Commit every complete shard: data file, error file, then the manifest naming them."""
    for shard, results in feed.tracker.pop_complete():
        data_name, error_name = shard_names(shard, fmt)
        ok = [r for r in results if r.ok]
        bad = [r for r in results if not r.ok]
        store.write_atomic(data_name, encode_results(ok, fmt))
        store.write_atomic(error_name, encode_errors(bad, fmt))
        first = shard * manifest.rows_per_shard
        manifest.shards[shard] = ShardRecord(
            first_row=first,
            end_row=first + len(results),
            ok=len(ok),
            errors=len(bad),
            data=data_name,
            error_file=error_name,
            prompt_tokens=sum(r.prompt_tokens for r in ok),
            completion_tokens=sum(r.completion_tokens for r in ok),
        )
        manifest.save(store)
        report.shards_committed += 1
        report.rows_this_run += len(results)


def _discard(store: OutputStore, manifest: Manifest) -> None:
    """--fresh: remove an earlier run's shards (committed or not), report and manifest."""
    for name in store.list("shards/") + store.list("errors/"):
        store.delete(name)
    store.delete(REPORT_NAME)
    store.delete(Manifest.file_name(manifest.job))


def _fill_totals(report: JobReport, manifest: Manifest) -> None:
    report.rows_ok = sum(s.ok for s in manifest.shards.values())
    report.rows_failed = sum(s.errors for s in manifest.shards.values())
    report.rows_total = manifest.total_rows or manifest.rows_done


def _make_executor(spec: JobSpec, expected_rows: int | None) -> Any:
    if spec.execution.executor == "ray":
        from tokenmill.jobs.ray_executor import RayExecutor

        return RayExecutor(spec, expected_rows=expected_rows)
    from tokenmill.jobs.local_executor import RowProcessor

    return RowProcessor(spec)
