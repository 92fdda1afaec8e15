"""Record: one raw row from a file, before it is checked and turned into an InputRow."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Record:
    """A raw row. ``position`` is the 1-based line (JSONL) or 0-based row (Parquet).

    ``error`` is set when the row could not even be decoded (not UTF-8, not JSON); ``value``
    is then None, or, for a Parquet row one of whose values Python cannot hold, the row's
    other values (for its id). Otherwise ``value`` is whatever the file holds (a dict for
    Parquet; any JSON value for JSONL, which the row parser rejects unless it is an object).
    """

    position: int
    value: Any = None
    error: str | None = None


class RecordSource(Protocol):
    """An open input file that streams Records (``JsonlRecords``, ``ParquetRecords``)."""

    url: str

    def has_column(self, name: str) -> bool:
        """Whether the file's data has this column (Parquet: schema; JSONL: first object)."""
        ...

    def columns_hint(self) -> str:
        """The file's column names, for 'no column X' messages; "" when unknown."""
        ...

    def __iter__(self) -> Iterator[Record]: ...
