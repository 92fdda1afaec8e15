"""Counting input rows cheaply, for the progress bar's total and ETA.

``input_row_total`` counts local files and Parquet metadata exactly and estimates remote
JSONL files from a sample of each (row_estimate.py): counting those exactly was a second
download of the whole input."""

from __future__ import annotations

import logging
import threading

from tokenmill.io.readers import InputConfig, list_input_files
from tokenmill.io.readers.compression import open_input
from tokenmill.io.readers.file_reads import map_files
from tokenmill.io.readers.format_detection import format_by_name
from tokenmill.io.readers.jsonl_records import blank_line
from tokenmill.io.readers.parquet_footers import footer_of
from tokenmill.jobs.row_estimate import RowTotal, Stopped, estimate_rows, is_local

__all__ = ["RowTotal", "input_row_total"]

log = logging.getLogger("tokenmill.jobs")

_STOP_EVERY = (1 << 16) - 1  # lines between looks at ``stop`` (a mask)


def input_row_total(cfg: InputConfig, stop: threading.Event | None = None) -> RowTotal | None:
    """The input's rows for progress: Parquet files' from their metadata and local JSONL
    files' counted (both exact), remote JSONL files' estimated from a sample of each
    (``estimate_rows``: the rows of a file no larger than the sample are counted); None if
    they cannot be counted or estimated, or once ``stop`` is set. Never raises: a total only
    feeds the progress bar (and, estimated, never the manifest or the report)."""
    try:
        files = list_input_files(cfg)
        fmt = _format_by_name(cfg, files)

        def count(url: str) -> int:
            return _rows_of(url, fmt, cfg, stop)

        local: list[str] = []
        remote: list[str] = []
        for f in files:
            (local if fmt == "parquet" or is_local(f, cfg.storage_options) else remote).append(f)
        counted = sum(map_files(count, local))
        if not remote:
            return RowTotal(counted, estimated=False)
        estimate = estimate_rows(remote, cfg.storage_options, count, stop)
        return None if estimate is None else RowTotal(counted + estimate.rows, estimate.estimated)
    except Stopped:
        return None
    except Exception as exc:  # the reader reports real problems with the input itself
        log.debug("could not count input rows: %s", exc)
        return None


def _rows_of(url: str, fmt: str, cfg: InputConfig, stop: threading.Event | None) -> int:
    if stop is not None and stop.is_set():
        raise Stopped
    if fmt == "parquet":  # (a footer the fingerprint read already: not again)
        return footer_of(url, cfg).num_rows
    rows = 0
    with open_input(url, cfg.storage_options) as f:
        # one line at a time: 65,536 of them held at once were a whole file of long
        # documents in memory (900 MB of 0.5 MB rows)
        for i, line in enumerate(f, start=1):
            rows += not blank_line(line, i)
            if not i & _STOP_EVERY and stop is not None and stop.is_set():
                raise Stopped
    return rows


def _format_by_name(cfg: InputConfig, files: list[str]) -> str:
    """ "parquet" or "jsonl", by the setting or the first file's name (detect_format's rule,
    ``format_by_name``): detect_format also peeks into the first file (a 256 KiB block from
    an object store, more than an estimate's sample of a small file), which the count does
    not need; the reader checks the format. A name that says no format raises (the job
    refuses such an input: no total)."""
    if cfg.format != "auto":
        return "parquet" if cfg.format == "parquet" else "jsonl"
    return format_by_name(files[0]) if files else "jsonl"
