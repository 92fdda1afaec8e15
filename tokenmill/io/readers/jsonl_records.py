"""JsonlRecords: stream a JSON Lines file line by line, whatever its size."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any

from tokenmill.io.readers.record import Record
from tokenmill.io.readers.storage import resolve

# How many lines to look through for the first JSON object when deciding which columns
# the file has; a file that starts with more unreadable lines than this is treated as
# having none.
_PEEK_LINES = 1000


class JsonlRecords:
    """An open JSONL file; iterate it for Records, one per non-blank line.

    Blank lines are skipped but keep their line numbers, so ``position`` is the line an editor
    shows. Use as a context manager; the file is read through fsspec in blocks, never whole.
    """

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.url = url
        self._storage_options = storage_options
        self._file: IO[bytes] | None = None
        self._first_keys: frozenset[str] | None = None

    def __enter__(self) -> JsonlRecords:
        fs, path = resolve(self.url, self._storage_options)
        self._file = fs.open(path, "rb")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def has_column(self, name: str) -> bool:
        """Whether the file's first JSON object has key ``name`` (JSONL has no schema)."""
        if self._first_keys is None:
            self._first_keys = self._peek_first_keys()
        return name in self._first_keys

    def columns_hint(self) -> str:
        return ""

    def __iter__(self) -> Iterator[Record]:
        f = self._opened()
        f.seek(0)
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            yield _decode(line_no, raw)

    def _peek_first_keys(self) -> frozenset[str]:
        f = self._opened()
        f.seek(0)
        keys: frozenset[str] = frozenset()
        for line_no, raw in enumerate(f, start=1):
            if line_no > _PEEK_LINES:
                break
            if not raw.strip():
                continue
            record = _decode(line_no, raw)
            if isinstance(record.value, dict):
                keys = frozenset(record.value)
                break
        f.seek(0)
        return keys

    def _opened(self) -> IO[bytes]:
        if self._file is None:
            raise RuntimeError(f"JsonlRecords({self.url!r}) used outside its 'with' block")
        return self._file


def _decode(line_no: int, raw: bytes) -> Record:
    try:
        # utf-8-sig on line 1 drops a byte-order mark some editors write.
        text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError as e:
        return Record(line_no, error=f"line is not valid UTF-8 ({e.reason} at byte {e.start})")
    try:
        return Record(line_no, value=json.loads(text))
    except json.JSONDecodeError as e:
        return Record(line_no, error=f"line is not valid JSON ({e.msg} at column {e.colno})")
