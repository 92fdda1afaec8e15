"""Counting input rows cheaply, for the progress bar's total and ETA."""

from __future__ import annotations

import logging
import threading

import fsspec

from tokenmill.io.readers import InputConfig, detect_format, list_input_files
from tokenmill.io.readers.compression import open_input
from tokenmill.io.readers.file_reads import map_files
from tokenmill.io.readers.jsonl_records import blank_line

log = logging.getLogger("tokenmill.jobs")

_STOP_EVERY = (1 << 16) - 1  # lines between looks at ``stop`` (a mask)


class _Stopped(Exception):
    pass


def count_input_rows(cfg: InputConfig, stop: threading.Event | None = None) -> int | None:
    """Rows in the input (non-blank JSONL lines, after decompression for a compressed file;
    Parquet metadata row counts), its files read ``READERS`` at a time; None if they
    cannot be counted, or once ``stop`` is set (checked between files and every 65,536
    lines). Never raises: a count only feeds the progress bar."""
    try:
        files = list_input_files(cfg)
        fmt = detect_format(files, cfg.format, cfg.storage_options)
        return sum(map_files(lambda url: _rows_of(url, fmt, cfg, stop), files))
    except _Stopped:
        return None
    except Exception as exc:  # the reader reports real problems with the input itself
        log.debug("could not count input rows: %s", exc)
        return None


def _rows_of(url: str, fmt: str, cfg: InputConfig, stop: threading.Event | None) -> int:
    if stop is not None and stop.is_set():
        raise _Stopped
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with fsspec.open(url, "rb", **cfg.storage_options) as f:
            return pq.ParquetFile(f).metadata.num_rows
    rows = 0
    with open_input(url, cfg.storage_options) as f:
        # one line at a time: 65,536 of them held at once were a whole file of long
        # documents in memory (900 MB of 0.5 MB rows)
        for i, line in enumerate(f, start=1):
            rows += not blank_line(line, i)
            if not i & _STOP_EVERY and stop is not None and stop.is_set():
                raise _Stopped
    return rows
