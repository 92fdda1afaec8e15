"""ParquetRecords: stream a Parquet file in record batches, reading only the needed columns."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.io.readers.compression import CorruptInputError
from tokenmill.io.readers.record import Record
from tokenmill.io.readers.storage import resolve

# Rows per decoded batch: bounds the Python objects alive at once. Arrow still holds one row
# group's column chunks of the selected columns, a size the file's writer chose.
PARQUET_BATCH_ROWS = 1024


class ParquetRecords:
    """An open Parquet file; iterate it for Records (dicts of the wanted columns it has).

    ``position`` is the 0-based row in the file. Use as a context manager.
    Raises ValueError naming the file when it is not readable Parquet.
    """

    def __init__(self, url: str, storage_options: dict[str, Any], wanted: Sequence[str]) -> None:
        self.url = url
        self._storage_options = storage_options
        self._wanted = tuple(dict.fromkeys(wanted))
        self._file: IO[bytes] | None = None
        self._parquet: pq.ParquetFile | None = None
        self._columns: tuple[str, ...] = ()
        self._types: dict[str, pa.DataType] = {}

    def __enter__(self) -> ParquetRecords:
        fs, path = resolve(self.url, self._storage_options)
        self._file = fs.open(path, "rb")
        try:
            self._parquet = pq.ParquetFile(self._file)
        except (pa.ArrowException, OSError) as e:
            self._file.close()
            if not _corrupt(e):
                raise
            raise CorruptInputError(f"{self.url} is not a readable Parquet file: {e}") from e
        schema = self._parquet.schema_arrow
        self._columns = tuple(schema.names)
        self._types = {f.name: f.type for f in schema}
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._parquet = None

    def has_column(self, name: str) -> bool:
        return name in self._columns

    def column_types(self) -> dict[str, pa.DataType]:
        """{column: its Arrow type} from the file's schema."""
        return dict(self._types)

    def columns_hint(self) -> str:
        return ", ".join(self._columns)

    def __iter__(self) -> Iterator[Record]:
        if self._parquet is None:
            raise RuntimeError(f"ParquetRecords({self.url!r}) used outside its 'with' block")
        columns = [c for c in self._wanted if c in self._columns]
        position = 0
        try:
            for batch in self._parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
                for value in batch.to_pylist():
                    yield Record(position, value=value)
                    position += 1
        except (pa.ArrowException, OSError) as e:
            if not _corrupt(e):
                raise
            raise CorruptInputError(
                f"{self.url}: Parquet read failed after row {position - 1}: {e}; "
                "the file is truncated or corrupt"
            ) from e


def _corrupt(exc: BaseException) -> bool:
    """Whether pyarrow failed on the file's bytes (a footer or page it cannot decode: an
    ArrowException, or the bare OSError without an errno its decompressors raise) rather
    than on reading them (the store's own OSErrors: a missing file, a refused or dropped
    connection), which keep their type and meaning."""
    if isinstance(exc, pa.ArrowException):
        return True
    return type(exc) is OSError and exc.errno is None
