"""The job runner: spec in, committed shards and a report out, resumable at any moment.

checks (output location, input, spec) ─► lock ─► ownership ─► manifest (fingerprint, shard
files verified, stray shard files removed; shards without a manifest refused) ─► the output
schema (Parquet: fixed before the first shard, kept in the manifest) ─► then three threads,
joined by bounded queues (pipeline_bounds.py):

    reader thread:  read ─► skip committed shards ─► template + tokenize (RowFeed)
                    ─► planner: dedup, length order in a window (RowFeed, FeedPlan)
    engine thread:  executor (the engine, kept full) ─► shard tracker ─► complete shards
    writer thread:  encode ─► commit data + error files ─► manifest (ShardWriter)

─► report.json and report.html (plots of the run's history: run_history.py). The engine
thread is the caller's: it alone touches the tracker and the progress bar, and it re-raises
a worker's error as that worker raised it, so exit codes and messages are those of a serial
run. A stop (``cancel``, SIGTERM) ends the engine loop, then the complete shards are
committed; a second signal (JobInterrupted) leaves at once.

Times: ``model_load_seconds`` is building the executor (the local engine), plus the first
Ray replica's own start; ``generation_seconds``, what throughput is over, runs from the model
loaded (the first replica up) to the executor's last result; ``wall_seconds`` from
``run_job``'s call to the report's writing (taken just before it: the end's checks and saves
are the run's). A job found complete loads nothing, says so ("nothing to do") and leaves
its report.json as the run that completed it wrote it (written anew only when it is missing
or does not say complete: that run was killed before writing it).
report.json is the commit point of the pair: report.html is written first, so a run that
stops between the two (killed, disk full) leaves a report.json that does not say complete
and the rerun writes both. A found-complete run also rewrites report.html from report.json
where the page is missing or shows another report (left so by versions that wrote
report.json first).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from tokenmill.engine.chat_messages import check_tools_rendered
from tokenmill.engine.engine_config import EngineSettingError
from tokenmill.engine.loader import resolve_model_source
from tokenmill.engine.sampling_params import ids_outside_vocab
from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.readers import InputConfig, fingerprint_input
from tokenmill.io.readers.input_fingerprint import (
    InputFingerprint,
    shown_url,
    unchanged_by_versions,
)
from tokenmill.io.storage import OutputStore, make_folder
from tokenmill.io.url_secrets import hide_url_secrets
from tokenmill.jobs.counted import counted
from tokenmill.jobs.error_chain import in_chain
from tokenmill.jobs.fingerprint import (
    JobSettings,
    earlier_fingerprints,
    fingerprint,
    job_settings,
    settings_record,
)
from tokenmill.jobs.input_changes import file_changes
from tokenmill.jobs.input_count import InputCount
from tokenmill.jobs.legacy_shards import conform_legacy_shards
from tokenmill.jobs.lock import JobLock, JobLockedError, LockLostError
from tokenmill.jobs.manifest import (
    InputChangedError,
    Manifest,
    ManifestError,
    OutputChangedError,
)
from tokenmill.jobs.output_links import check_no_links
from tokenmill.jobs.ownership import (
    REPORT_HTML_NAME,
    REPORT_NAME,
    OutputOwnedError,
    check_claimable,
    check_not_inside_another,
    claim_output,
)
from tokenmill.jobs.peekable_input import PeekableInput
from tokenmill.jobs.pipeline_bounds import PipelineBounds
from tokenmill.jobs.preflight import (
    check_up_front,
    input_config,
    output_schema,
    store_failure,
)
from tokenmill.jobs.progress import Progress
from tokenmill.jobs.replica_dtype import check_replica_dtype, dtype_on, kept_dtype, replica_dtype
from tokenmill.jobs.report import JobReport
from tokenmill.jobs.report_html import (
    import_plots_in_background,
    page_shows,
    write_report_html,
)
from tokenmill.jobs.row_count import input_row_total
from tokenmill.jobs.row_feed import FeedPlan, RowFeed
from tokenmill.jobs.rows_kept import mark_rows_kept
from tokenmill.jobs.run_history import RunHistory, device_of, replica_counters
from tokenmill.jobs.shard_commit import (
    discard_progress,
    progress_files,
    remove_stray_files,
    some_files,
)
from tokenmill.jobs.shard_size import with_shard_size
from tokenmill.jobs.shard_tracker import ShardTracker
from tokenmill.jobs.shard_writer import ShardWriter
from tokenmill.jobs.spec import JobSpec, JobSpecError, coerce_spec
from tokenmill.jobs.stop_signals import JobInterrupted

__all__ = [
    "feed_plan",
    "input_config",
    "open_output",
    "pipeline_bounds",
    "run_job",
    "settings_of",
]

log = logging.getLogger("tokenmill.jobs")


def open_output(spec: JobSpec) -> tuple[OutputStore, JobLock]:
    """The job's output store and its lock. Raises JobSpecError for an unusable output.path
    (OutputPathError for a local one holding a symbolic link)."""
    try:
        store = OutputStore(spec.output.path, dict(spec.output.storage_options), owner=spec.name)
    except ValueError as exc:
        raise JobSpecError(str(exc)) from None
    local_dir = store.root if store.is_local else None
    if local_dir is not None:
        check_no_links(local_dir)
    return store, JobLock(spec.name, store.url, local_dir, store.identity)


def settings_of(
    spec: JobSpec,
    cfg: InputConfig,
    kept: JobSettings | None = None,
    found: InputFingerprint | None = None,
) -> tuple[JobSettings, tuple[str, ...]]:
    """What the job's fingerprint covers (the input's files as ``cfg`` lists them), and the
    fingerprints earlier versions gave it where they differ (``earlier_fingerprints``), or
    the model's earlier path did where ``kept`` (the manifest's settings) says it moved.
    ``found``: the input's fingerprint (``fingerprint_input(cfg)``) where taken already. Raises
    JobSpecError naming model.source when the model cannot be found, and
    sampling.logit_bias when it names ids past the model's vocabulary (a check only the
    model can make)."""
    try:
        source = resolve_model_source(spec.model.source)
        template = spec.model.chat_template or source.chat_template()
        config = source.load_config()
    except (FileNotFoundError, ValueError) as exc:
        raise JobSpecError(f"model.source: {exc}") from None
    if spec.input.messages_column is not None or spec.model.chat_template is not None:
        _check_chat_template(template, spec)  # else every conversation would fail
    vocab = config.vocab_size if spec.sampling.logit_bias else 0
    outside = ids_outside_vocab(spec.sampling.logit_bias, vocab)
    if outside:  # every row would fail on them
        raise JobSpecError(
            f"sampling.logit_bias: token ids {outside[:5]} are outside the model's vocabulary "
            f"[0, {vocab})"
        )
    if found is None:
        found = fingerprint_input(cfg)
    settings = job_settings(
        spec,
        source.path,
        template,
        found.digest,
        found.counts,
        found.versions,
        found.entries,
        found.format,
    )
    if spec.model.dtype == "auto" and spec.execution.executor == "local":
        settings["resolved_dtype"] = _resolved_dtype(spec, config)
    return settings, earlier_fingerprints(settings, found.earlier, spec, kept)


def _check_chat_template(template: str | None, spec: JobSpec) -> None:
    """Raise JobSpecError when the job has no chat template (neither the model nor
    model.chat_template), one that never reads the tools model.chat_template_kwargs gives,
    or one (any of its named ones) that does not compile, as transformers compiles it to
    render conversations."""
    model = spec.model.source
    if template is None:
        raise JobSpecError(
            f"input.messages_column: model {model!r} has no chat template to render "
            "conversations with; use a chat model, give one in model.chat_template, or "
            "plain prompts (prompt_column)"
        )
    try:
        check_tools_rendered(template, spec.model.chat_template_kwargs)
    except ValueError as exc:  # else every conversation would fail on it
        raise JobSpecError(f"model.chat_template_kwargs.tools: {exc}") from None
    try:  # (transformers' own compiler, with its extensions; skipped where it moved)
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return
    named = json.loads(template) if template.startswith('{"') else {"default": template}
    for name, text in named.items():
        try:
            _compile_jinja_template(text)
        except TemplateError as exc:
            if spec.model.chat_template is not None:
                raise JobSpecError(
                    f"model.chat_template: the template does not compile "
                    f"({type(exc).__name__}: {exc})"
                ) from None
            raise JobSpecError(
                f"input.messages_column: the chat template {name!r} of model {model!r} does "
                f"not compile ({type(exc).__name__}: {exc}); fix chat_template.jinja or "
                "tokenizer_config.json's chat_template, or give one in model.chat_template"
            ) from None


def _resolved_dtype(spec: JobSpec, config: Any) -> str:
    """What ``model.dtype: auto`` is on the device this process runs the engine on (fp32 on
    a CPU, the checkpoint's on a GPU): a job begun on one and resumed on the other would mix
    them. (Ray replicas resolve it on their own nodes: replica_dtype.py.)"""
    from tokenmill.jobs.local_executor import engine_config

    try:
        device = engine_config(spec).resolve_device()
    except EngineSettingError as exc:
        raise JobSpecError(f"engine.{exc}") from None
    return dtype_on(spec, config, device)


def run_job(
    spec: JobSpec | str | os.PathLike | dict[str, Any],
    *,
    fresh: bool = False,
    cancel: threading.Event | None = None,
    show_progress: bool = True,
    progress_interval_s: float = 10.0,
    on_progress: Callable[[Progress], None] | None = None,
) -> JobReport:
    """Run (or resume) the job to completion. ``spec`` may be a JobSpec, a path to a job.yaml
    or a dict of sections. Progress is logged every ``progress_interval_s`` seconds (a bar
    instead on a terminal) when ``show_progress``.

    ``on_progress`` is handed the run's Progress once generation starts (``submit``'s
    handle reads it).

    Raises JobSpecError (OutputPathError, OutputOwnedError) when the spec cannot work: the
    output is the root, the input or inside it, or belongs to another job; the input cannot
    be read or does not fit the output format. Raises JobLockedError when another run holds
    the output, FingerprintMismatchError when the output holds another configuration's
    progress (unless ``fresh``). Per-row problems never raise: they go to the error files.
    """
    start = time.monotonic()  # report.json's wall_seconds: the checks are the run's too
    spec = coerce_spec(spec)
    cfg = check_up_front(spec)
    store, lock = open_output(spec)
    # (before the lock: its file would be left among the other job's files)
    _reachable(store, lambda: check_not_inside_another(store, spec.name))
    try:
        lock.acquire()
    except JobLockedError as exc:
        owner = _reachable(store, lambda: check_claimable(store, spec.name))  # not ours: 2
        if owner is None and exc.holder_job not in (None, spec.name):
            # Unclaimed, and another job is claiming it now: it will be that job's.
            raise OutputOwnedError(
                f"output.path {store.url} is being claimed by job {exc.holder_job!r}, running "
                f"now; job {spec.name!r} wrote nothing. Give each job its own output.path."
            ) from None
        raise
    try:
        shown = progress_interval_s if show_progress else None
        return _run_locked(
            spec, cfg, store, lock, fresh, cancel or threading.Event(), shown, on_progress, start
        )
    finally:
        lock.release()


def _reachable(store: OutputStore, check: Any) -> Any:
    """Run ``check`` (a first read of the output); its store client's errors become an error
    naming output.path (``store_failure``: exit 2, or 75 for a store out of reach)."""
    try:
        return check()
    except (JobSpecError, JobInterrupted):
        raise
    except Exception as exc:
        raise store_failure(
            f"output.path {store.url!r}", exc, "output.storage_options (endpoint_url, credentials)"
        ) from None


def _run_locked(
    spec: JobSpec,
    cfg: InputConfig,
    store: OutputStore,
    lock: JobLock,
    fresh: bool,
    cancel: threading.Event,
    progress_interval_s: float | None,
    on_progress: Callable[[Progress], None] | None,
    start: float,
) -> JobReport:
    """The run under ``lock``, held: its ``check_held`` fences every commit (lock.py).
    ``start``: when ``run_job`` was called (``time.monotonic()``), what wall_seconds counts from."""
    still_held = lock.check_held
    report = JobReport(
        job=spec.name, output=hide_url_secrets(store.url), executor=spec.execution.executor
    )
    owner = _reachable(store, lambda: check_claimable(store, spec.name))
    manifest = None if fresh else Manifest.load(store, spec.name)
    if manifest is None and not fresh:
        _refuse_progress_without_manifest(store, spec.name)
    if manifest is not None and not manifest.shards and not manifest.complete:
        manifest = None  # no progress to mix (a run that stopped before its first shard)
    # Before a Parquet schema's passthrough types: the fingerprint reads each file's last MiB
    # in parallel and keeps the footer there (cfg.footers), which the types are then taken
    # from; after them, every footer but the first was read again, one file after another.
    # (Else after the model's checks, which a typo in model.source fails at once.)
    early = manifest is None and cfg.footers is not None and bool(cfg.passthrough_columns)
    found = fingerprint_input(cfg) if early else None
    # A fresh job reads its first rows here, to size its shards, and its feed goes on from
    # them (not read twice); they are read with the Parquet schema it fixes now, as the feed's.
    source = None if manifest is not None else PeekableInput(cfg, output_schema(spec, cfg))
    try:
        spec = with_shard_size(spec, source, manifest)  # (the count the fingerprint covers)
        kept = None if manifest is None else manifest.settings  # (the model may have moved)
        settings, earlier = settings_of(spec, cfg, kept, found)  # the files check_input listed
        fp, record = fingerprint(settings), settings_record(settings)
        record = kept_dtype(spec, kept, record)
        if fresh:
            discard_progress(store, spec.name)
        saved = (
            manifest is not None
            and (manifest.fingerprint, manifest.settings) == (fp, record)
            and not manifest.journaled
        )
        if manifest is not None:
            manifest.check_fingerprint(fp, record, store.url, earlier)
            manifest.fingerprint, manifest.settings = fp, record
        claim_output(store, spec.name, fp, owner)
        if manifest is None:
            manifest = Manifest(spec.name, fp, spec.output.rows_per_shard, settings=record)
            manifest.output_schema = None if source is None else source.schema
        if not saved:  # (a rerun with nothing new rewrote it whole: 0.7 s, 7 MB at 30k shards)
            manifest.save(store)
        recount: list[Callable[[], None]] = []  # _run_owned's, for a second signal's report
        try:
            return _run_owned(spec, cfg, source, store, manifest, report, start, cancel,
                              progress_interval_s, on_progress, recount, still_held)  # fmt: skip
        except LockLostError:  # the output may be another run's now: not even a report
            raise
        except Exception as exc:
            _fill_totals(report, manifest)  # the rows committed so far (they were 0)
            changed = _rewritten_while_read(exc, cfg)
            _record_failure(store, report, changed or exc, start)
            mark_rows_kept(changed or exc, report.rows_ok + report.rows_failed)
            if changed is not None:
                raise changed from exc
            raise
        except (JobInterrupted, KeyboardInterrupt) as exc:  # a second signal: gone at once
            # The report as a parting word, not a wait: the store may be what hangs (a PUT
            # stuck for 30 s held a second SIGTERM's exit that long).
            writer = threading.Thread(
                target=_last_report,
                args=(store, report, manifest, exc, start, recount),
                name="tokenmill-last-report",
                daemon=True,
            )
            writer.start()
            writer.join(_LAST_REPORT_S)
            raise
    finally:  # (a run that failed before its feed: the read ends here)
        if source is not None:
            source.close()


def _run_owned(
    spec: JobSpec,
    cfg: InputConfig,
    source: PeekableInput | None,
    store: OutputStore,
    manifest: Manifest,
    report: JobReport,
    start: float,
    cancel: threading.Event,
    progress_interval_s: float | None,
    on_progress: Callable[[Progress], None] | None,
    recount: list[Callable[[], None]],
    still_held: Callable[[], None],
) -> JobReport:
    """The run, once the output is the job's (claimed, its manifest saved), over the input
    files ``cfg`` lists (a fresh job's through ``source``, its first rows read already).
    Appends to ``recount`` what brings ``report``'s counts of this run's commits up to date
    once its writer has settled (``_last_report``).
    ``still_held`` raises once the output's lock is no longer this run's; it runs before
    each commit (the writer's) and before the final manifest and report."""
    removed = store.cleanup_temp()
    if removed:
        log.info("removed %s left by an interrupted run", counted(removed, "temporary file"))
    _verify_committed(store, manifest, report)
    schema = _fix_output_schema(spec, store, manifest, cfg)
    # Committed by earlier runs: whether or not this run's reader gets to them (it had
    # counted those it read, so a run that failed or was cancelled early said 0).
    report.rows_resumed = manifest.rows_done

    if manifest.complete:
        _fill_totals(report, manifest)
        report.status = "complete"
        report.model = spec.model.source  # no engine ran: no device, no tokens this run
        report.wall_seconds = round(time.monotonic() - start, 3)
        log.info("job %s: %s", spec.name, report.nothing_to_do_line())
        saved = _saved_complete_report(store)
        if saved is None:  # the run that completed it stopped before writing report.json
            _write_report(store, report)
        else:
            _repair_report_html(store, saved)
        return report

    import_plots_in_background()  # report.html's, hidden by the model load
    count, executor = _count_and_load(spec, cfg, cancel, report)
    writer: ShardWriter | None = None
    try:  # the loaded engine is closed below, or here where the run fails before that
        if spec.execution.executor == "ray" and executor is not None:  # (its cluster joined)
            dtype = replica_dtype(spec, executor.on_gpu)
            check_replica_dtype(manifest, dtype, store, still_held)
        progress = Progress(
            None,  # (until counted: the first row never waits for the count)
            manifest.rows_done,
            enabled=progress_interval_s is not None,
            interval_s=progress_interval_s or 10.0,
            live=None if executor is None else executor.live,
            counters=None if executor is None else replica_counters(executor),
            max_tokens=_row_output_bound(spec, executor),
            completions=spec.sampling.best_of or 1,
        )
        count.show_in(progress)
        generate = executor is not None and not cancel.is_set()  # (cancelled: it never does)
        if on_progress is not None and generate:
            on_progress(progress)
        tracker = ShardTracker(spec.output.rows_per_shard)
        bounds = pipeline_bounds(spec)
        writer = ShardWriter(
            store, manifest, spec.output.format, bounds.queued_shards, schema, still_held
        )
        done_before = frozenset(manifest.shards)
        feed = RowFeed(
            cfg,
            done_before,
            tracker,
            progress,
            spec.model.source,
            getattr(executor, "prepare", None),  # local: rows are tokenized on the reader thread
            bounds,
            schema,
            feed_plan(spec),
            on_results=lambda: _hand_over_complete(tracker, writer),  # bad rows' shards too
            source=source,
        )
    except BaseException:  # an on_progress that raised kept the engine (and its KV cache) for
        count.stop()
        if writer is not None:  # as long as its exception lived: +260 MB a run (an audit)
            writer.abandon()
        if executor is not None:
            executor.close()
        raise
    history = progress.history  # what report.html plots

    def count_commits() -> None:
        """``report``'s counts of what this run committed, from the writer and manifest."""
        report.shards_committed = writer.shards_committed
        report.rows_this_run = writer.rows_committed
        # the copies this run committed (a cancel's others are made again by the next run;
        # a failed run's too: its report said 0 beside committed copies, an audit)
        committed = set(manifest.shards) - done_before
        report.rows_deduplicated, report.deduplicated_tokens = feed.deduplicated_in(committed)

    def settled_counts() -> None:
        writer.settle()
        count_commits()
        report.rows_not_committed = _rows_not_committed(progress, writer)

    recount.append(settled_counts)
    # From the model loaded, as the plot's samples (Progress's clock): taken after the feed's
    # set-up, the plot's last point read 5.61 s against 4.92 s of generation (tok/s 14% high).
    generating = progress.start
    generated: float | None = None  # when the executor's stream ended
    try:
        if generate:
            progress.start_heartbeat()  # (finish and close stop it)
            for result in executor.process(feed, cancel, progress.tick):
                tracker.add_result(result)
                feed.finished(result)  # copies for the rows held as its duplicates
                report.prompt_tokens += result.prompt_tokens
                report.completion_tokens += result.generated_tokens  # best_of's extra too
                history.add_result(result)
                progress.update(1, result.generated_tokens)
                _hand_over_complete(tracker, writer)
        progress.finish()
        generated = progress.ended_at  # the instant of the plot's last point
        _hand_over_complete(tracker, writer)
        writer.finish()
    except BaseException as exc:
        if not progress.ended:  # a failed run shows no rows in flight, no ETA
            _finish_quietly(progress)  # (before the last commits: its sample ends the plot)
        generated = generated or progress.ended_at or time.monotonic()
        _stop_writer(writer, exc)
        # as a cancel's: rows finished in shards not complete, computed again by a rerun
        report.rows_not_committed = _rows_not_committed(progress, writer)
        raise
    finally:
        generated = generated or time.monotonic()
        count.stop()
        # counted, never estimated (None: stopped before the count; a complete run's is read)
        report.rows_total = progress.exact_total
        feed.close(timeout=0.5 if writer.abandoned else 5.0)
        progress.close()
        report.throughput_over_time = progress.samples
        # Rows dropped at a cancel generated tokens too (the live count has them): this run's
        # engine work, as README says (the finished rows' alone made the rate ~6x too low).
        report.completion_tokens = max(report.completion_tokens, progress.tokens)
        count_commits()
        # Ray replicas load their models inside the generation loop: load time until the first
        # is up, generation from then (taking the slowest's start out as well dropped the
        # others' work meanwhile: 72 tokens "over 0.065 s", 1,108 tok/s, where they ran ~1 s)
        late_load = min(getattr(executor, "first_up_seconds", 0.0), generated - generating)
        report.model_load_seconds = round(report.model_load_seconds + late_load, 3)
        report.generation_seconds = round(generated - generating - late_load, 3)
        report.model = spec.model.source
        if history.prompt_lengths.count:
            report.prompt_lengths = history.prompt_lengths.to_dict()
            report.output_lengths = history.output_lengths.to_dict()
        if executor is not None:
            report.device = device_of(executor)
            counters = executor.counters
            report.prefix_cache_hit_rate = counters.prefix_cache_hit_rate
            report.preemptions = counters.preemptions
            method = spec.engine.speculative.method
            if method != "off":
                report.speculative = counters.speculative(method)
            failures = getattr(executor, "failures", None)  # Ray's replicas only
            if failures is not None:
                report.replica_failures = asdict(failures)
            executor.close()

    still_held()  # (the writer checked at each commit; the manifest and report are next)
    # A cancel that came once the input was read to its end and every row had its result
    # changes nothing: the run is complete.
    if cancel.is_set() and not (feed.exhausted and not tracker.num_pending_rows):
        report.status = "cancelled"
        report.rows_not_committed = _rows_not_committed(progress, writer)
    else:
        if tracker.num_pending_rows:
            raise RuntimeError(
                f"{tracker.num_pending_rows} rows got no result; "
                "the job is incomplete (rerun to resume)"
            )
        _check_input_unchanged(cfg, manifest)
        _check_commits_stand(store, manifest)
        manifest.complete = True
        manifest.total_rows = feed.rows_read
        manifest.save(store)
        report.status = "complete"
        if store.is_local:  # readers open shards/ even when no row landed there (no input)
            make_folder(os.path.join(store.root, "shards"))
    _fill_totals(report, manifest)
    # (taken last: the input re-check, manifest save and engine close above are the run's)
    report.wall_seconds = round(time.monotonic() - start, 3)
    _write_report(store, report, history)
    return report


def _check_input_unchanged(cfg: InputConfig, manifest: Manifest) -> None:
    """Raise InputChangedError when the input's files are not what the run's fingerprint,
    taken at its start, describes: a file rewritten, appended to or replaced while the run
    read it left rows of both contents in the output, and the run said it was complete (the
    next run refused the changed input; a folder's new files are not read: the next run
    refuses them)."""
    settings = manifest.settings or {}
    if "input" not in settings:
        return
    started = settings.get("input_versions") or {}
    try:
        if unchanged_by_versions(cfg, started, settings.get("input_files")):
            return  # every object's version as at the start: no file read again
        now, files, versions, entries, *_ = fingerprint_input(cfg, fresh=True)  # not cached
    except FileNotFoundError as exc:  # an input file deleted or moved since the start
        gone = shown_url(str(exc.filename or exc))
        raise _input_changed(cfg, f" (input files gone: {gone})") from None
    rewritten = sorted(url for url, v in versions.items() if started.get(url, v) != v)
    if now == settings["input"] and not rewritten:
        return
    before = settings.get("input_files")
    sizes = f" ({before['bytes']:,} -> {files['bytes']:,} bytes)" if before else ""
    if rewritten:  # (an object rewritten at its size: its version says so, its hash may not)
        more = f" and {len(rewritten) - 1} more" if len(rewritten) > 1 else ""
        sizes += f" ({hide_url_secrets(rewritten[0])}{more} written again in storage)"
    elif "input_entries" in settings and entries:
        sizes += "".join(f" ({c})" for c in file_changes(settings["input_entries"], entries))
    raise _input_changed(cfg, sizes)


def _input_changed(cfg: InputConfig, detail: str) -> InputChangedError:
    """The error of an input that changed while the run read it, ``detail`` (" (...)",
    or "") saying how."""
    return InputChangedError(
        f"the input ({shown_url(cfg.path)}) changed while this run read it{detail}: " + _CHANGED
    )


_CHANGED = (
    "a file was rewritten, appended to or replaced, so the rows it wrote may be of either "
    "content and the job is not complete. Rerun with --fresh once the input stays as it is "
    "(give a changed input a new name)."
)


def _rewritten_while_read(exc: Exception, cfg: InputConfig) -> InputChangedError | None:
    """The InputChangedError that ``exc`` is, if it is s3fs's refusal to read an input
    file rewritten since its listing (s3fs reads with the version the listing gave:
    "FileExpired ... filename <bucket/key> and Etag ..."); None for any other failure."""
    inputs = {url.split("://", 1)[-1] for url in cfg.files or ()}

    def an_input_expired(e: BaseException) -> bool:  # (a key may hold spaces: an audit)
        said = str(e)
        named = any(f"filename {key} and Etag" in said for key in inputs)
        return type(e).__name__ == "FileExpired" and named

    expired = in_chain(exc, an_input_expired)
    if expired is None:
        return None
    return _input_changed(cfg, f" ({hide_url_secrets(str(expired))})")


# How long a run stopped by a second signal waits for its report to be written.
_LAST_REPORT_S = 2.0


def _last_report(
    store: OutputStore,
    report: JobReport,
    manifest: Manifest,
    exc: BaseException,
    start: float,
    recount: list[Callable[[], None]],
) -> None:
    """Write the report of a run cut short by a second stop signal, on a thread the run
    waits for ``_LAST_REPORT_S`` at most. A shard record being written at the stop may still
    land: ``recount`` waits for it before the counts are read, so they are what a rerun finds
    (read at the stop, they said one shard fewer than the manifest). Where that write hangs,
    so does this, and no report is written: none would be true. report.json goes first and
    report.html has no plots (``_report_writes``' ``at_once``): drawing them took longer
    than the wait on a slow host, which left an earlier run's report.json (4 of 10 second
    signals, an audit), and a thread still drawing as the process exited aborted it."""
    for settle in recount:
        settle()
    _fill_totals(report, manifest)
    _record_failure(store, report, exc, start, "cancelled", at_once=True)


def _record_failure(
    store: OutputStore,
    report: JobReport,
    exc: BaseException,
    start: float,
    status: str = "failed",
    at_once: bool = False,
) -> None:
    """Write report.json and report.html saying the run failed (or, ``status``, was cut
    short by a second stop signal) and why: the last run's report stayed, its status
    ("cancelled", "complete") read as this run's by whatever watches the job (the page's
    too, beside a report.json that said "failed"). ``at_once``: the writes of a second
    signal's report (``_report_writes``). Best effort: the store may be what failed."""
    report.status = status
    report.error = hide_url_secrets(f"{type(exc).__name__}: {exc}")
    report.wall_seconds = round(time.monotonic() - start, 3)
    for name, write in _report_writes(store, report, at_once=at_once):
        try:
            write()
        except Exception as write_error:
            # Name the file that failed; report.json, unless it was written, still holds
            # what an earlier run wrote (or nothing).
            kept = "" if name == REPORT_NAME or not at_once else "not "
            log.warning(
                "could not write %s saying the run %s (%s); %s is %sleft as it was, and a "
                "rerun writes both",
                name,
                status,
                write_error,
                REPORT_NAME,
                kept,
            )
            return


def pipeline_bounds(spec: JobSpec) -> PipelineBounds:
    """How far the reader and the writer threads may get ahead (rows, shards)."""
    return PipelineBounds.for_engine(spec.engine.max_num_seqs)


def _row_output_bound(spec: JobSpec, executor: Any) -> int:
    """The output tokens a row takes at most, the ETA's bound on a row in flight: max_tokens
    a completion, x best_of. A completion's prompt and output fit the context, so a
    max_tokens past it (100,000 for "no limit") bounds nothing: taken as the bound, a row
    longer than every finished one was taken to go on to it ("ETA 3 h 25 min" 10 s from the
    end). The context is the local engine's, else the spec's; Ray replicas load theirs
    later, and Progress lowers the bound to it once one is up (LiveCounts.max_model_len)."""
    per_completion = spec.sampling.max_tokens
    context = getattr(executor, "max_model_len", None) or spec.engine.max_model_len
    if context is not None:
        per_completion = min(per_completion, context)
    return per_completion * (spec.sampling.best_of or 1)


def feed_plan(spec: JobSpec) -> FeedPlan:
    """How the feed orders and deduplicates the job's rows (the planner section)."""
    return FeedPlan(
        spec.planner.settings(),
        spec.sampling.model_dump(),
        spec.engine.max_num_batched_tokens,
    )


def _report_writes(
    store: OutputStore,
    report: JobReport,
    history: RunHistory | None = None,
    at_once: bool = False,
) -> list[tuple[str, Callable[[], None]]]:
    """The writes of a report, (file name, write) in the order they must run: report.html
    (with the plots of ``history``, where the run has one), then report.json. report.json
    is the commit point: a found-complete job keeps a report.json that says complete, so
    written first it outlived a report.html that failed after it (disk full), and the page
    stayed missing or another run's for good (an audit). Written last, a failure leaves
    report.json as it was (not "complete" from this run) and the rerun writes both.

    ``at_once`` (a second stop signal's report, ``_last_report``, with a moment to be
    written): report.json first, the truth a rerun or a scheduler reads, then report.html
    without plots. Its status is never "complete", so the rerun writes both anyway."""

    def write_json() -> None:
        store.write_atomic(REPORT_NAME, report.to_json().encode())

    if at_once:
        plain = (REPORT_HTML_NAME, lambda: write_report_html(store, report, None, _NO_PLOTS))
        return [(REPORT_NAME, write_json), plain]
    return [(REPORT_HTML_NAME, lambda: write_report_html(store, report, history)),
            (REPORT_NAME, write_json)]  # fmt: skip


_NO_PLOTS = (
    "no plots: the run was stopped at once by a second stop signal; the summary above has "
    "its numbers, and the rerun's page its plots"
)


def _write_report(store: OutputStore, report: JobReport, history: RunHistory | None = None) -> None:
    """report.html, then report.json (``_report_writes``): every run that writes the one
    writes the other; a store failure raises, with report.json left as it was."""
    for _name, write in _report_writes(store, report, history):
        write()


def _saved_complete_report(store: OutputStore) -> JobReport | None:
    """The output's report.json where it is there and says the job is complete (the report
    of the run that completed it), else None: missing, not complete, or not a report."""
    try:
        saved = JobReport.from_json(store.read_bytes(REPORT_NAME) or b"{}")
    except (ValueError, TypeError, AttributeError):  # unreadable or another shape: rewritten
        return None
    return saved if saved.status == "complete" else None


def _repair_report_html(store: OutputStore, saved: JobReport) -> None:
    """Write report.html from the complete job's report.json (``saved``) where the page is
    missing or shows another report: versions that wrote report.json first left it so when
    report.html then failed, and no later run rewrote it. A page that shows ``saved`` is left
    alone; checking costs one read and no matplotlib (``page_shows``). A failing store
    raises, as writing the report does."""
    if page_shows(store.read_bytes(REPORT_HTML_NAME), saved):
        return
    log.info("%s is missing or not %s's page: written again from it", REPORT_HTML_NAME, REPORT_NAME)
    write_report_html(store, saved, None)  # the run's history is gone; its report has the rest


def _refuse_progress_without_manifest(store: OutputStore, job: str) -> None:
    """Raise ManifestError when the output holds shards or journal records of ``job`` but no
    manifest (moved or deleted): nothing says which settings made them."""
    files = progress_files(store, job)
    if files:
        raise ManifestError(
            f"{hide_url_secrets(store.url)} holds {counted(len(files), 'file')} of the "
            f"progress of job {job!r} ({some_files(files)}) but not its manifest, "
            f"{Manifest.file_name(job)}: the settings that made this progress are unknown, so "
            "it cannot be resumed; rerun with --fresh to discard it and start over"
        )


def _shard_file_sizes(store: OutputStore) -> dict[str, int]:
    """{name: bytes} of the output's shard data and error files, as they are now."""
    return store.sizes("shards/") | store.sizes("errors/")


def _check_commits_stand(store: OutputStore, manifest: Manifest) -> None:
    """Before a run calls the job complete: every file its committed shards name is there at
    the size written. The lock keeps a second run off the output only from this machine (and
    HOME, for object stores); another machine's run with ``--fresh``, or a person, may have
    removed some meanwhile, and "complete" would then hide missing rows until a rerun."""
    missing = manifest.missing_shards(_shard_file_sizes(store))
    if missing:
        first, problems = next(iter(missing.items()))
        # A rerun recomputes the shards only from the manifest: where it went too (another
        # run's --fresh), the rerun refuses the shards left and --fresh is what works.
        if store.exists(Manifest.file_name(manifest.job)):
            again = "rerun to recompute them"
        else:
            again = (
                f"its manifest, {Manifest.file_name(manifest.job)}, is gone too, so a rerun "
                "cannot resume: rerun with --fresh to discard them and start over"
            )
        raise OutputChangedError(
            f"{counted(len(missing), 'shard')} this job committed changed under this run "
            f"(shard {first}: "
            f"{'; '.join(problems)}): another run on {hide_url_secrets(store.url)} (from a "
            "machine or HOME whose lock this run cannot see) or a person removed or rewrote "
            f"them, so the job is not complete; {again}, one run per output at a time"
        )


def _verify_committed(store: OutputStore, manifest: Manifest, report: JobReport) -> None:
    """Forget committed shards whose files are gone or changed size, so they are recomputed;
    then remove the shard files no committed shard names (``remove_stray_files``)."""
    sizes = _shard_file_sizes(store)
    restored = manifest.restore_superseded(sizes)
    if restored:
        log.info(
            "%s the manifest's record (the files match it; journal records left by an "
            "earlier run of a newer version did not): shard %d first",
            counted(len(restored), "shard keeps", "shards keep"),
            restored[0],
        )
    dropped = manifest.drop_missing_shards(sizes)
    if dropped:
        log.warning(_recomputed_line(dropped))
        report.shards_recomputed = len(dropped)
        report.shards_recomputed_list = sorted(dropped)
    if dropped or restored:
        manifest.save(store)
    removed = remove_stray_files(store, manifest, sizes)
    if removed:
        log.info(
            "removed %s no committed shard names (an earlier run's)", counted(removed, "shard file")
        )


def _recomputed_line(dropped: dict[int, list[str]]) -> str:
    """One warning for the shards ``drop_missing_shards`` dropped: a removed ``shards/``
    folder drops every shard, and a line each put hundreds of lines before the summary."""
    first, problems = next(iter(dropped.items()))
    if len(dropped) == 1:
        return f"shard {first} is recomputed: {'; '.join(problems)}"
    shown = ", ".join(str(i) for i in sorted(dropped)[:5])
    more = ", ..." if len(dropped) > 5 else ""
    return (
        f"{len(dropped)} committed shards are recomputed, their files gone or changed "
        f"(shards {shown}{more}; shard {first}: {'; '.join(problems)}); report.json's "
        "shards_recomputed_list names them all"
    )


def _fix_output_schema(
    spec: JobSpec, store: OutputStore, manifest: Manifest, cfg: InputConfig
) -> OutputSchema | None:
    """The job's Parquet schema: the one its manifest records, or, on a first run, the one
    decided now from the input and recorded before any shard. None for other formats.

    A manifest of an earlier version has committed shards but no schema: those shards are
    brought to the schema where no value changes (``conform_legacy_shards``); the others are
    kept, with a warning saying how to read them or start over."""
    if spec.output.format != "parquet":
        return None
    if manifest.output_schema is not None:
        return manifest.output_schema
    schema = manifest.output_schema = output_schema(spec, cfg)
    if manifest.shards:
        log.info(
            "bringing %s to the job's one schema", counted(len(manifest.shards), "earlier shard")
        )
        kept = conform_legacy_shards(store, manifest, schema)
        if kept:
            columns = ", ".join(f"{k}: {v}" for k, v in schema.describe().items())
            log.warning(
                "%d shards committed by an earlier tokenmill keep passthrough column types of "
                "their own (their values do not fit the job's schema, %s, unchanged); read the "
                "shards with duckdb's union_by_name, or rerun with --fresh for one schema",
                kept,
                columns or "no passthrough columns",
            )
    manifest.save(store)
    return schema


def _stop_writer(writer: ShardWriter, exc: BaseException) -> None:
    """The run is failing with ``exc``: commit the complete shards handed over (as a serial
    run would have), unless it is a second stop signal, which leaves at once (as safe as
    SIGKILL). A second signal while waiting for the writer leaves at once too."""
    if isinstance(exc, (JobInterrupted, KeyboardInterrupt)) or exc is writer.error:
        writer.abandon()
        return
    try:
        writer.finish_quietly()
    except BaseException:
        writer.abandon()
        raise


def _rows_not_committed(progress: Progress, writer: ShardWriter) -> int:
    """Rows this run finished whose shards it did not commit (a cancel's, a failure's): a
    rerun computes them again."""
    return max(progress.done_this_run - writer.rows_committed, 0)


def _hand_over_complete(tracker: ShardTracker, writer: ShardWriter) -> None:
    """Give every complete shard to the writer (data file, error file, then the manifest).
    Raises the writer's error as soon as it failed, not only at the next complete shard."""
    writer.check()
    for shard, results in tracker.pop_complete():
        writer.submit(shard, results)


def _finish_quietly(progress: Progress) -> None:
    """End a failed run's progress: its last sample reads the executor, which may be what
    failed; the run's own error is the one raised, not this."""
    try:
        progress.finish()  # (ended, with no row in flight, even when its sample raises)
    except Exception:
        log.debug("could not take the last progress sample of a failed run", exc_info=True)


def _fill_totals(report: JobReport, manifest: Manifest) -> None:
    """The report's row counts from the manifest; ``rows_total`` the input's rows: a
    complete job's, else the count taken before the run (``report.rows_total``, None if the
    run stopped before it), never the rows committed so far."""
    report.rows_ok = sum(s.ok for s in manifest.shards.values())
    report.rows_failed = sum(s.errors for s in manifest.shards.values())
    if manifest.complete:  # every row committed (a manifest before total_rows: counted so)
        total = manifest.total_rows
        report.rows_total = manifest.rows_done if total is None else total


def _count_and_load(
    spec: JobSpec, cfg: InputConfig, cancel: threading.Event, report: JobReport
) -> tuple[InputCount, Any]:
    """(the input's row total, for progress; the executor, None once cancelled). A local
    run counts beside its model load and its rows, never waiting for the count (local JSONL
    counted row by row, remote JSONL estimated from a sample: row_estimate.py); a Ray one
    first, its chunks being sized by it (an estimate sizes them as well: the rows read, not
    the count, decide when the input has ended)."""
    if spec.execution.executor == "ray":
        total = input_row_total(cfg)
        rows = None if total is None else total.rows
        executor = None if cancel.is_set() else _load_executor(spec, rows, report)
        return InputCount.known(total), executor
    count = InputCount.start(input_row_total, cfg)
    try:
        executor = None if cancel.is_set() else _load_executor(spec, None, report)
    except BaseException:
        count.stop()  # (the process would wait for the count to end)
        raise
    if executor is None or cancel.is_set():  # cancelled: no progress to show, no count
        count.stop()  # (a cancel during the load waited for the whole count: 26 s on S3)
    return count, executor


def _load_executor(spec: JobSpec, expected_rows: int | None, report: JobReport) -> Any:
    """The executor, its model loaded (local) or its Ray cluster joined (Ray replicas load
    theirs when their first rows arrive); says so before and after. Sets
    ``report.model_load_seconds``."""
    model = spec.model.source
    if spec.execution.executor == "ray":
        log.info(
            "starting Ray for %d replicas of model %s (each loads it when its first rows "
            "arrive) ...",
            spec.execution.replicas,
            model,
        )
    else:
        log.info("loading model %s ...", model)
    loading = time.monotonic()
    try:
        executor = _make_executor(spec, expected_rows)
    except EngineSettingError as exc:  # checked against the device: kv_cache_memory
        raise JobSpecError(f"engine.{exc}") from exc
    except (ValueError, FileNotFoundError) as exc:  # the model's files: a rerun does not help
        from tokenmill.jobs.local_executor import ContextCutError  # (imported by now)

        if isinstance(exc, ContextCutError):  # not the model's fault: the settings'
            raise JobSpecError(str(exc)) from exc
        raise JobSpecError(f"model.source {model!r} cannot be loaded: {exc}") from exc
    report.model_load_seconds = round(time.monotonic() - loading, 3)
    if spec.execution.executor == "ray":
        log.info("Ray ready in %.1f s", report.model_load_seconds)
    else:
        log.info("model loaded in %.1f s", report.model_load_seconds)
    return executor


def _make_executor(spec: JobSpec, expected_rows: int | None) -> Any:
    if spec.execution.executor == "ray":
        from tokenmill.jobs.ray_executor import RayExecutor

        return RayExecutor(spec, expected_rows=expected_rows)
    from tokenmill.jobs.local_executor import RowProcessor

    return RowProcessor(spec)
