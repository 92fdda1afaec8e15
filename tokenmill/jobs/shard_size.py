"""shard_size: how many rows a job's shards hold when job.yaml leaves out
``output.rows_per_shard``.

An open shard holds its rows in memory until it commits, their passthrough values included:
1,000 rows of a 5 MB passthrough column are 5 GB per open shard. So a fresh job weighs its
first input rows (``row_bytes``) and gives its shards as many rows as fit ``SHARD_BYTES``:

    sample: the first rows, up to DEFAULT_ROWS_PER_SHARD of them or SHARD_BYTES of them
    rows_per_shard = SHARD_BYTES // (sampled bytes / sampled rows), in [1, DEFAULT_ROWS_PER_SHARD]

The count is the resume contract (shard k holds rows [k*n, (k+1)*n)): the manifest records
it, and a resumed job keeps the manifest's (a job begun by a version that had 1000 for every
job resumes with 1000), whatever a new sample would say. An explicit ``output.rows_per_shard``
always wins; one other than the manifest's is a changed setting, as before (the fingerprint
covers the count in effect).

The sampled rows are the run's own first rows (PeekableInput): the reader thread starts
from them rather than reading them again.
"""

from __future__ import annotations

import logging

from tokenmill.jobs.manifest import Manifest
from tokenmill.jobs.peekable_input import PeekableInput
from tokenmill.jobs.spec import JobSpec

__all__ = ["DEFAULT_ROWS_PER_SHARD", "SHARD_BYTES", "peeked_rows_per_shard", "with_shard_size"]

log = logging.getLogger("tokenmill.jobs")

DEFAULT_ROWS_PER_SHARD = 1000  # the most; what every job had before the count adapted
# An open shard's rows, about: a few of them are open at once (the writer's queue), and the
# estimate is within a small factor of what Python holds.
SHARD_BYTES = 64 << 20


def with_shard_size(
    spec: JobSpec, source: PeekableInput | None, manifest: Manifest | None
) -> JobSpec:
    """``spec`` with the ``output.rows_per_shard`` its run uses: the one job.yaml gives, else
    the ``manifest``'s (its progress, resumed), else one picked from the first rows of
    ``source`` (logged), which ``source`` keeps for the run: they are not read again.
    ``source`` may be None only with a ``manifest``. A read error among the first rows is
    not raised here: the run meets it after the rows before it (PeekableInput), and the
    count is picked from those."""
    if spec.output.rows_per_shard_given:
        return spec
    if manifest is not None:
        count = manifest.rows_per_shard
    elif source is None:
        raise ValueError("with_shard_size: a job without a manifest needs its input to sample")
    else:
        count, read, mean = peeked_rows_per_shard(source)
        log.info(
            "output.rows_per_shard: %d (the first %d input rows hold about %d bytes each; a "
            "shard's rows at most about %d MiB); set output.rows_per_shard to choose",
            count,
            read,
            mean,
            SHARD_BYTES >> 20,
        )
    output = spec.output.model_copy(update={"rows_per_shard": count})
    return spec.model_copy(update={"output": output})


def peeked_rows_per_shard(source: PeekableInput) -> tuple[int, int, int]:
    """(rows per shard, rows sampled, their mean bytes) from the first rows of ``source``,
    which it keeps (``PeekableInput.peek``)."""
    read, total = source.peek(DEFAULT_ROWS_PER_SHARD, SHARD_BYTES)
    if read == 0:
        return DEFAULT_ROWS_PER_SHARD, 0, 0
    mean = max(1, total // read)
    return max(1, min(DEFAULT_ROWS_PER_SHARD, SHARD_BYTES // mean)), read, mean
