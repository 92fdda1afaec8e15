"""What a run's start-up learns of each Parquet input file's footer, kept for the run.

    check_input ─► files listed, InputConfig.footers made (Parquet input)
    fingerprint ─► each file's last MiB read for its hash: the footer is there ─► kept
    row total, passthrough types ─► a file's footer from there, else read (one GET on S3)

Before, the row total and the passthrough types each read every file's footer again after
the fingerprint had read the bytes holding it: a folder of 1,000 Parquet files on an object
store was 2,000 more requests before the first row.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.io.readers.parquet_records import ParquetRecords

if TYPE_CHECKING:
    from tokenmill.io.readers.input_config import InputConfig

__all__ = ["ParquetFooter", "ParquetFooters", "footer_from_tail", "footer_of"]

_MAGIC = b"PAR1"  # a plain (unencrypted) Parquet file's last four bytes


@dataclass(frozen=True)
class ParquetFooter:
    """What a Parquet file's footer says that a run needs after its checks: its rows, and
    the Arrow types of the job's passthrough columns it has (``ParquetRecords``' own)."""

    num_rows: int
    types: dict[str, pa.DataType]

    @classmethod
    def of(cls, parquet: pq.ParquetFile, columns: tuple[str, ...]) -> ParquetFooter:
        types = {f.name: f.type for f in parquet.schema_arrow}  # (ParquetRecords': last wins)
        return cls.of_types(parquet.metadata.num_rows, types, columns)

    @classmethod
    def of_types(
        cls, num_rows: int, types: dict[str, pa.DataType], columns: tuple[str, ...]
    ) -> ParquetFooter:
        """From a file's rows and column types: those of ``columns`` it has kept."""
        return cls(num_rows, {c: types[c] for c in columns if c in types})


class ParquetFooters:
    """The footers of one run's input files (``InputConfig.files``) by URL, as read once.
    Shared by the copies ``dataclasses.replace`` makes of the config; filled from the
    fingerprint's threads."""

    def __init__(self) -> None:
        self._by_url: dict[str, ParquetFooter] = {}
        self._lock = threading.Lock()

    def get(self, url: str) -> ParquetFooter | None:
        with self._lock:
            return self._by_url.get(url)

    def keep(self, url: str, footer: ParquetFooter) -> None:
        with self._lock:
            self._by_url[url] = footer


def footer_from_tail(tail: bytes, columns: tuple[str, ...]) -> ParquetFooter | None:
    """The footer held in ``tail``, a Parquet file's last bytes (the whole file, or its end),
    or None where they do not hold all of it (a footer longer than ``tail``), or the file is
    not plain Parquet: its reader then reads it, failing as it did."""
    if len(tail) < 12 or not tail.endswith(_MAGIC):
        return None
    if int.from_bytes(tail[-8:-4], "little") + 8 > len(tail):
        return None
    try:
        return ParquetFooter.of(pq.ParquetFile(pa.BufferReader(tail)), columns)
    except (pa.ArrowException, OSError, ValueError):
        return None


def footer_of(url: str, cfg: InputConfig) -> ParquetFooter:
    """``url``'s footer: as kept in ``cfg.footers``, else read from the file (and kept).
    Raises what ``ParquetRecords`` raises for a file that is not readable Parquet."""
    if cfg.footers is not None:
        footer = cfg.footers.get(url)
        if footer is not None:
            return footer
    with ParquetRecords(url, cfg.storage_options, []) as records:
        footer = ParquetFooter.of_types(
            records.num_rows, records.column_types(), cfg.passthrough_columns
        )
    if cfg.footers is not None:
        cfg.footers.keep(url, footer)
    return footer
