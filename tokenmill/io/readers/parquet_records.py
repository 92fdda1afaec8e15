"""ParquetRecords: stream a Parquet file in record batches, reading only the needed columns.

Values become Python objects a batch at a time. A value Python cannot hold makes its row an
error naming it, not the file's (a timestamp past year 9999, a struct with two fields of one
name); so does a ``time64[ns]`` value with nanoseconds (in a struct, list or map too), which
``datetime.time`` would cut to microseconds. A file with two columns of one name that the job
reads is refused: which one a row would take is not defined.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.io.nested_types import with_child_types
from tokenmill.io.output_schema import zones_in_utc
from tokenmill.io.readers.compression import CorruptInputError
from tokenmill.io.readers.record import Record
from tokenmill.io.readers.storage import is_read_error, read_failed, resolve

# Rows per decoded batch: bounds the Python objects alive at once. Arrow still holds one row
# group's column chunks of the selected columns, a size the file's writer chose.
PARQUET_BATCH_ROWS = 1024
# Bytes per decoded batch (by the footer's uncompressed sizes): fewer rows a batch when rows
# are wide, as 1,024 rows of a 5 MB column were 5 GB of Python strings at once (an audit).
PARQUET_BATCH_BYTES = 16 << 20


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
        twice = sorted({c for c in self._wanted if self._columns.count(c) > 1})
        if twice:
            self.__exit__()
            raise CorruptInputError(
                f"{self.url} has {self._columns.count(twice[0])} columns named {twice[0]!r}; "
                "a row could take either: rename or drop the extra ones"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._parquet = None

    def has_column(self, name: str) -> bool:
        return name in self._columns

    @property
    def num_rows(self) -> int:
        """Rows in the file, from its footer."""
        return self._parquet.metadata.num_rows if self._parquet is not None else 0

    def column_types(self) -> dict[str, pa.DataType]:
        """{column: its Arrow type} from the file's schema."""
        return dict(self._types)

    def footer(self) -> tuple[pq.FileMetaData, pa.Schema]:
        """The file's Parquet metadata (its row groups' statistics too) and Arrow schema."""
        if self._parquet is None:
            raise RuntimeError(f"ParquetRecords({self.url!r}) used outside its 'with' block")
        return self._parquet.metadata, self._parquet.schema_arrow

    def columns(self) -> tuple[str, ...]:
        """The file's column names, in its schema's order."""
        return self._columns

    def columns_hint(self) -> str:
        return ", ".join(self._columns)

    def __iter__(self) -> Iterator[Record]:
        if self._parquet is None:
            raise RuntimeError(f"ParquetRecords({self.url!r}) used outside its 'with' block")
        columns = [c for c in self._wanted if c in self._columns]
        batch_rows = _batch_rows(self._parquet.metadata, columns)
        position = 0
        try:
            for batch in self._parquet.iter_batches(batch_size=batch_rows, columns=columns):
                for record in _records(batch, position):
                    yield record
                    position += 1
        except (pa.ArrowException, OSError) as e:
            if not _corrupt(e):
                if isinstance(e, OSError):  # the store's or the disk's: name the file read
                    raise read_failed(self.url, e) from e
                raise
            raise CorruptInputError(
                f"{self.url}: Parquet read failed after row {position - 1}: {e}; "
                "the file is truncated or corrupt"
            ) from e
        except Exception as e:
            if is_read_error(e):  # a store client's own type (botocore's), through pyarrow
                raise read_failed(self.url, e) from e
            raise


def _batch_rows(metadata: pq.FileMetaData, columns: Sequence[str]) -> int:
    """Rows a decoded batch: ``PARQUET_BATCH_ROWS``, or fewer so that a batch of the widest
    row group's rows holds about ``PARQUET_BATCH_BYTES`` of ``columns`` (at least one row)."""
    prefixes = tuple(f"{c}." for c in columns)  # a nested column's leaves: "col.list.element"
    wanted = set(columns)
    widest = 0.0  # uncompressed bytes a row, in the row group of the widest rows
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        if group.num_rows == 0:
            continue
        size = 0
        for c in range(group.num_columns):
            chunk = group.column(c)
            path = chunk.path_in_schema
            if path in wanted or path.startswith(prefixes):
                size += chunk.total_uncompressed_size
        widest = max(widest, size / group.num_rows)
    if widest <= 0:
        return PARQUET_BATCH_ROWS
    return max(1, min(PARQUET_BATCH_ROWS, int(PARQUET_BATCH_BYTES // widest)))


def _corrupt(exc: BaseException) -> bool:
    """Whether pyarrow failed on the file's bytes (a footer or page it cannot decode: an
    ArrowException, or the bare OSError without an errno its decompressors raise) rather
    than on reading them (the store's own OSErrors: a missing file, a refused or dropped
    connection), which keep their type and meaning."""
    if isinstance(exc, pa.ArrowException):
        return True
    return type(exc) is OSError and exc.errno is None


def _records(batch: pa.RecordBatch, start: int) -> list[Record]:
    """The batch's rows as Records from row ``start``: its values as Python objects, a row
    whose value cannot be one (exactly) an error naming the column."""
    bad = _inexact_rows(batch)
    try:
        values = batch.to_pylist()
    except _UNCONVERTIBLE:
        values = None  # find the rows: one at a time
    records = []
    for i in range(batch.num_rows):
        if i in bad:
            value = values[i] if values is not None else _convertible(batch.slice(i, 1))
            records.append(Record(start + i, value=value, error=bad[i]))
            continue
        if values is not None:
            records.append(Record(start + i, value=values[i]))
            continue
        row = batch.slice(i, 1)
        try:
            records.append(Record(start + i, value=row.to_pylist()[0]))
            continue
        except _UNCONVERTIBLE:
            pass
        try:  # a zoned timestamp whose local time is past year 9999 (or before 1): in UTC
            in_utc = [zones_in_utc(c) for c in row.columns]
            utc_row = pa.RecordBatch.from_arrays(in_utc, names=row.schema.names)
            records.append(Record(start + i, value=utc_row.to_pylist()[0]))
        except _UNCONVERTIBLE:
            records.append(Record(start + i, value=_convertible(row), error=_unconvertible(row)))
    return records


def _convertible(row: pa.RecordBatch) -> dict[str, Any]:
    """The one-row ``row``'s values Python can hold (the others None): its id, for the
    row's error."""
    value = {}
    for name, column in zip(row.schema.names, row.columns, strict=True):
        try:
            value[name] = column.to_pylist()[0]
        except _UNCONVERTIBLE:
            value[name] = None
    return value


_UNCONVERTIBLE = (OverflowError, ValueError, NotImplementedError, pa.ArrowException)


def _unconvertible(row: pa.RecordBatch) -> str:
    """Which column of the one-row ``row`` Python cannot hold, and why."""
    for name, column in zip(row.schema.names, row.columns, strict=True):
        try:
            column.to_pylist()
        except _UNCONVERTIBLE as e:
            return f"column {name!r} holds a {column.type} value Python cannot hold ({e})"
    return "a value Python cannot hold"


def _inexact_rows(batch: pa.RecordBatch) -> dict[int, str]:
    """{row: why} for rows with a ``time64[ns]`` value that is not whole microseconds, in a
    column of that type or nested in one (a struct's field, a list's or a map's values)."""
    bad: dict[int, str] = {}
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        in_us = _time_in_us(column.type)
        if in_us == column.type or _casts_exactly(column, in_us):
            continue
        for i in range(len(column)):  # find the rows: one at a time
            if column[i].is_valid and not _casts_exactly(column.take([i]), in_us):
                bad.setdefault(
                    i,
                    f"column {name!r} holds a time64[ns] value with nanoseconds, which cannot "
                    "be passed through exactly (Python's time holds microseconds); cast it "
                    "to time64[us] or to int64",
                )
    return bad


def _casts_exactly(column: pa.Array, dtype: pa.DataType) -> bool:
    """Whether ``column`` casts to ``dtype`` without losing data."""
    try:
        column.cast(dtype)  # safe: refuses to drop nanoseconds
    except pa.ArrowInvalid:
        return False
    return True


def _time_in_us(dtype: pa.DataType) -> pa.DataType:
    """``dtype`` with ``time64[ns]`` as ``time64[us]``, inside structs, lists and maps too:
    the type its values keep as Python objects."""
    if dtype == pa.time64("ns"):
        return pa.time64("us")
    return with_child_types(dtype, _time_in_us)
