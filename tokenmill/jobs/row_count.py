"""Counting input rows cheaply, for the progress bar's total and ETA."""

from __future__ import annotations

import logging

import fsspec

from tokenmill.io.readers import InputConfig, detect_format, list_input_files
from tokenmill.io.readers.compression import open_input

log = logging.getLogger("tokenmill.jobs")


def count_input_rows(cfg: InputConfig) -> int | None:
    """Rows in the input (non-blank JSONL lines, after decompression for a compressed file;
    Parquet metadata row counts), or None if the files cannot be counted cheaply.
    Never raises: a count only feeds the progress bar."""
    try:
        files = list_input_files(cfg)
        fmt = detect_format(files, cfg.format, cfg.storage_options)
        total = 0
        for url in files:
            if fmt == "parquet":
                import pyarrow.parquet as pq

                with fsspec.open(url, "rb", **cfg.storage_options) as f:
                    total += pq.ParquetFile(f).metadata.num_rows
            else:
                with open_input(url, cfg.storage_options) as f:
                    total += sum(1 for line in f if line.strip())
        return total
    except Exception as exc:  # the reader reports real problems with the input itself
        log.debug("could not count input rows: %s", exc)
        return None
