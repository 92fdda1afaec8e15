"""Committing one shard, and discarding a job's own progress (``--fresh``).

A shard is committed as: data file, error file (each all-or-nothing), then the caller's
manifest names them with their sizes, which a resume checks. ``discard_progress`` removes
only files this job wrote: names of its own shard pattern, its report and its manifest.
"""

from __future__ import annotations

from tokenmill.io.rows import ResultRow
from tokenmill.io.shard_encoding import encode_shard
from tokenmill.io.storage import OutputStore
from tokenmill.io.writers import shard_index, shard_names
from tokenmill.jobs.manifest import Manifest, ShardRecord
from tokenmill.jobs.ownership import REPORT_NAME


def commit_shard(
    store: OutputStore, shard: int, results: list[ResultRow], fmt: str, rows_per_shard: int
) -> ShardRecord:
    """Write shard ``shard``'s data and error files; return the manifest's record of them.
    A row that cannot be written in ``fmt`` goes to the error file (``encode_shard``)."""
    data_name, error_name = shard_names(shard, fmt)
    encoded = encode_shard(results, fmt)
    store.write_atomic(data_name, encoded.data)
    store.write_atomic(error_name, encoded.errors)
    first = shard * rows_per_shard
    return ShardRecord(
        first_row=first,
        end_row=first + len(results),
        ok=len(encoded.ok_rows),
        errors=len(encoded.error_rows),
        data=data_name,
        error_file=error_name,
        prompt_tokens=sum(r.prompt_tokens for r in encoded.ok_rows),
        completion_tokens=sum(r.completion_tokens for r in encoded.ok_rows),
        data_bytes=len(encoded.data),
        error_bytes=len(encoded.errors),
    )


def discard_progress(store: OutputStore, manifest: Manifest) -> None:
    """--fresh: remove the job's shards (committed or not), report and manifest; nothing else."""
    for name in store.list("shards/") + store.list("errors/"):
        if _is_shard_file(name):
            store.delete(name)
    store.delete(REPORT_NAME)
    store.delete(Manifest.file_name(manifest.job))


def _is_shard_file(name: str) -> bool:
    """Whether ``name`` is exactly a name ``shard_names`` gives, in any output format."""
    try:
        index = shard_index(name)
    except ValueError:
        return False
    return name in shard_names(index, "parquet") + shard_names(index, "jsonl")
