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
"""

from __future__ import annotations

import logging

from tokenmill.io.readers import InputConfig
from tokenmill.io.readers.input_rows import iter_input_rows
from tokenmill.jobs.manifest import Manifest
from tokenmill.jobs.preflight import input_error
from tokenmill.jobs.row_bytes import input_row_bytes
from tokenmill.jobs.spec import JobSpec

__all__ = ["DEFAULT_ROWS_PER_SHARD", "SHARD_BYTES", "sampled_rows_per_shard", "with_shard_size"]

log = logging.getLogger("tokenmill.jobs")

DEFAULT_ROWS_PER_SHARD = 1000  # the most; what every job had before the count adapted
# An open shard's rows, about: a few of them are open at once (the writer's queue), and the
# estimate is within a small factor of what Python holds.
SHARD_BYTES = 64 << 20


def sampled_rows_per_shard(cfg: InputConfig) -> tuple[int, int, int]:
    """(rows per shard, rows sampled, their mean bytes) for the input of ``cfg``, from its
    first rows. Raises what ``iter_input_rows`` raises for an input that cannot be read."""
    read = total = 0
    rows = iter_input_rows(cfg)
    try:
        for row in rows:
            read += 1
            total += input_row_bytes(row)
            if read == DEFAULT_ROWS_PER_SHARD or total >= SHARD_BYTES:
                break
    finally:
        rows.close()
    if read == 0:
        return DEFAULT_ROWS_PER_SHARD, 0, 0
    mean = max(1, total // read)
    return max(1, min(DEFAULT_ROWS_PER_SHARD, SHARD_BYTES // mean)), read, mean


def with_shard_size(spec: JobSpec, cfg: InputConfig, manifest: Manifest | None) -> JobSpec:
    """``spec`` with the ``output.rows_per_shard`` its run uses: the one job.yaml gives, else
    the ``manifest``'s (its progress, resumed), else one sampled from the input of ``cfg``
    (logged). Raises JobSpecError naming input.path for an input that cannot be read."""
    if spec.output.rows_per_shard_given:
        return spec
    if manifest is not None:
        count = manifest.rows_per_shard
    else:
        try:
            count, read, mean = sampled_rows_per_shard(cfg)
        except (FileNotFoundError, ValueError) as exc:
            raise input_error(exc) from None
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
