"""Committing one shard, tidying the error files, and discarding a job's own progress.

A shard is committed as: data file (none for a JSON Lines shard without good rows: an
empty .jsonl file is one pyarrow's and polars' JSON readers refuse, failing the whole folder),
then its error file when it has bad rows (each all-or-nothing), then the caller's manifest
names them with their sizes, which a resume checks. ``remove_stray_files`` removes the data
and error files the manifest does not name (a crash's leftovers, and the empty files earlier
versions wrote). ``discard_progress``
(``--fresh``) removes only files this job wrote: names of its own shard pattern, its report
and its manifest with its journal.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.rows import ResultRow
from tokenmill.io.shard_encoding import write_shard
from tokenmill.io.storage import OutputStore, StorageError
from tokenmill.io.url_secrets import hide_url_secrets
from tokenmill.io.writers import shard_index, shard_names
from tokenmill.jobs.counted import counted
from tokenmill.jobs.manifest import Manifest, ShardRecord
from tokenmill.jobs.ownership import REPORT_HTML_NAME, REPORT_NAME


def commit_shard(
    store: OutputStore,
    shard: int,
    results: list[ResultRow],
    fmt: str,
    rows_per_shard: int,
    schema: OutputSchema | None = None,
) -> ShardRecord:
    """Write shard ``shard``'s data file, and its error file when a row failed; return the
    manifest's record of them. ``schema`` is the job's Parquet schema. A row that cannot be
    written in ``fmt`` (or does not fit ``schema``) goes to the error file (``write_shard``).

    No error file is written for a shard without bad rows; one left at its name by a crashed
    run must be gone first (``remove_stray_files``, at the start of a run)."""
    data_name, error_name = shard_names(shard, fmt)
    written = write_shard(store, data_name, results, fmt, schema)  # no empty .jsonl (see above)
    data_file = data_name if written.data_bytes is not None else None
    error_file = error_name if written.error_rows else None
    if error_file is not None:
        store.write_atomic(error_file, written.errors)
    first = shard * rows_per_shard
    return ShardRecord(
        first_row=first,
        end_row=first + len(results),
        ok=len(written.ok_rows),
        errors=len(written.error_rows),
        data=data_file,
        error_file=error_file,
        prompt_tokens=sum(r.prompt_tokens for r in written.ok_rows),
        completion_tokens=sum(r.completion_tokens for r in written.ok_rows),
        data_bytes=written.data_bytes,
        error_bytes=len(written.errors) if error_file is not None else None,
    )


def remove_stray_files(store: OutputStore, manifest: Manifest, names: Iterable[str]) -> int:
    """Delete the shard data and error files among ``names`` (the output's files) that
    ``manifest`` does not name; return how many. Call under the job's lock, before any shard
    is committed.

    Such a file was left by a run killed between a shard's files and its manifest entry: the
    shard is recomputed, maybe in another format or shard size (allowed while nothing is
    committed), maybe without bad rows and so without an error file, and the old file must
    not stay beside the new ones. Empty error files and empty JSON Lines data files of
    shards committed by earlier versions are first unlisted (the manifest saved without
    them), then deleted the same way. Only names of the job's own shard pattern are touched.
    """
    emptied = {
        index: kept
        for index, record in manifest.shards.items()
        if (kept := _without_empty_files(record)) != record
    }
    if emptied:
        manifest.shards.update(emptied)
        manifest.save(store)  # before the deletes: the manifest never names a missing file
    named = {name for record in manifest.shards.values() for name in record.files()}
    stray = sorted(n for n in names if _is_shard_file(n) and n not in named)
    # Batched on an object store: one DELETE a file took 3.5 s for 500 leftovers on a local
    # S3 before the run's first row (tens of seconds on a remote one; an audit).
    store.delete_many(stray)
    # (a stale error file left beside its recomputed shard would show its rows as failed
    # as well as done)
    left = store.still_there(stray)
    if left:
        raise StorageError(
            f"{hide_url_secrets(store.url)}: could not delete {counted(len(left), 'shard file')} "
            f"an earlier run left ({some_files(left)}): the store refused; check that "
            "the credentials may delete objects there, and rerun"
        )
    return len(stray)


def _without_empty_files(record: ShardRecord) -> ShardRecord:
    """``record`` without the empty files earlier versions wrote: an error file of a shard
    without bad rows, a JSON Lines data file of one without good rows."""
    if record.error_file is not None and record.errors == 0 and not record.error_bytes:
        record = replace(record, error_file=None, error_bytes=None)
    empty_data = record.ok == 0 and record.data_bytes == 0
    if record.data is not None and empty_data and not record.data.endswith(".parquet"):
        record = replace(record, data=None, data_bytes=None)
    return record


def progress_files(store: OutputStore, job: str) -> list[str]:
    """The files of job ``job``'s progress in ``store``: its shard data and error files and
    its manifest journal's records (not the manifest file itself)."""
    shards = [n for n in store.list("shards/") + store.list("errors/") if _is_shard_file(n)]
    return shards + store.list(Manifest.journal_prefix(job))


def some_files(names: list[str]) -> str:
    """The first three of ``names`` and how many more: for a message."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def discard_progress(store: OutputStore, job: str) -> None:
    """--fresh: remove job ``job``'s shards (committed or not), reports, manifest journal and
    manifest; nothing else. Needs no readable manifest. On an object store the files go in
    batched requests (``delete_many``): one request a file took 10 s for 2,400 shards on a
    local S3, and at ~30 ms a request would take 50 min for 100,000 on a remote one (an audit)."""
    files = progress_files(store, job)
    store.delete_many(files)  # the journal before the manifest
    # (a journal record left behind would be read back by the fresh run as its progress)
    left = store.still_there(files)
    if left:
        raise StorageError(
            f"{hide_url_secrets(store.url)}: --fresh could not delete {len(left)} of the "
            f"files of job {job!r} ({some_files(left)}): the store refused them; check that the "
            "credentials may delete objects there, and rerun with --fresh"
        )
    store.delete(REPORT_NAME)
    store.delete(REPORT_HTML_NAME)
    store.delete(Manifest.file_name(job))


def _is_shard_file(name: str) -> bool:
    """Whether ``name`` is exactly a name ``shard_names`` gives, in any output format."""
    try:
        index = shard_index(name)
    except ValueError:
        return False
    return name in shard_names(index, "parquet") + shard_names(index, "jsonl")
