"""Whether a Parquet file's timestamps and durations fit a finer unit, told by its footer.

pandas writes timestamps as ns; duckdb and Spark as us. Beside each other Arrow combines a
column into ns, whose int64 holds only the years 1677 to 2262: a coarser file's 9999-12-31
(the common "no end" marker) fitted no output row, and each such row was its row's error
while the job "completed". The footer's min/max statistics tell it before any row is read:

    column c ─► its leaf columns, depth-first as Parquet stores them (c.t, c.list.element, ...)
             ─► each timestamp / duration leaf whose unit the job's type makes finer
             ─► the extremes of its stored integers over every row group (min_raw, max_raw)
             ─► times the ratio of the units: inside int64, or the first extreme outside it
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["UnitOverflow", "has_finer_units", "unit_overflow"]

_NS_PER = {"s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}  # a unit's nanoseconds
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_PARQUET_UNITS = {"milliseconds": "ms", "microseconds": "us", "nanoseconds": "ns"}


@dataclass(frozen=True)
class UnitOverflow:
    """A leaf of a file's column whose values a finer unit may not hold.

    ``value``: a value of the file the finer unit cannot hold, as Arrow prints it; None where
    the file's footer has no statistics for the leaf (whether its values fit is unknown)."""

    file_type: pa.DataType  # the leaf's type in the file
    wanted: pa.DataType  # the leaf's type in the job's output
    value: str | None


def unit_overflow(
    metadata: pq.FileMetaData, schema: pa.Schema, column: str, wanted: pa.DataType
) -> UnitOverflow | None:
    """The first timestamp or duration leaf of ``column`` (in a file of ``metadata`` and Arrow
    ``schema``) whose values do not all fit ``wanted``'s finer unit there, or whose footer
    cannot tell; None when every value fits (the unit there is no finer, or the statistics'
    extremes fit)."""
    index = schema.get_field_index(column)
    if index < 0:
        return None
    first = sum(len(_leaves(f.type, None)) for f in list(schema)[:index])
    leaves = _leaves(schema.field(index).type, wanted)
    for i, (have, want) in enumerate(leaves):
        if not _finer(have, want):
            continue
        leaf = first + i
        if leaf >= metadata.num_columns or not metadata.schema.column(leaf).path.startswith(
            column
        ):  # leaves not as this walk counts them: a layout not known here, so unknown
            return UnitOverflow(have, want, None)
        extremes = _extremes(metadata, leaf)
        if extremes is None:
            return UnitOverflow(have, want, None)
        stored = _stored_unit(metadata.schema.column(leaf), have)
        ratio = _NS_PER[stored] // _NS_PER[want.unit]
        for raw in extremes:
            if not _INT64_MIN <= raw * ratio <= _INT64_MAX:
                return UnitOverflow(have, want, _shown(raw, stored, have))
    return None


def has_finer_units(have: pa.DataType, wanted: pa.DataType) -> bool:
    """Whether ``wanted`` holds a timestamp or duration of ``have`` in a finer unit (whether
    a file of ``have`` needs ``unit_overflow``'s look at its footer)."""
    return any(_finer(h, w) for h, w in _leaves(have, wanted))


def _leaves(
    have: pa.DataType, want: pa.DataType | None
) -> list[tuple[pa.DataType, pa.DataType | None]]:
    """(a leaf's type in the file, its type in ``want`` or None) for each leaf of ``have``,
    depth-first: the order of the file's Parquet leaf columns."""
    if pa.types.is_dictionary(have):
        return _leaves(have.value_type, want)
    if isinstance(have, pa.BaseExtensionType):
        return _leaves(have.storage_type, want)
    if pa.types.is_struct(have):
        found: list[tuple[pa.DataType, pa.DataType | None]] = []
        for f in have:
            at = (
                want.get_field_index(f.name)
                if want is not None and pa.types.is_struct(want)
                else -1
            )
            found += _leaves(f.type, want.field(at).type if at >= 0 else None)
        return found
    if pa.types.is_map(have):
        both = want is not None and pa.types.is_map(want)
        return _leaves(have.key_type, want.key_type if both else None) + _leaves(
            have.item_type, want.item_type if both else None
        )
    if hasattr(have, "value_type"):  # lists of every kind
        return _leaves(have.value_type, getattr(want, "value_type", None))
    return [(have, want)]


def _finer(have: pa.DataType, want: pa.DataType | None) -> bool:
    """Whether ``want`` holds ``have``'s times in a finer unit (a narrower range)."""
    timed = (pa.types.is_timestamp, pa.types.is_duration)
    return (
        want is not None
        and any(is_(have) and is_(want) for is_ in timed)
        and _NS_PER[want.unit] < _NS_PER[have.unit]
    )


def _extremes(metadata: pq.FileMetaData, leaf: int) -> tuple[int, int] | None:
    """The least and greatest stored integer of leaf column ``leaf`` over the file's row
    groups; None where a row group holding values has no min/max statistics for it."""
    low: int | None = None
    high: int | None = None
    for group in range(metadata.num_row_groups):
        chunk = metadata.row_group(group).column(leaf)
        stats = chunk.statistics
        if stats is not None and stats.has_min_max and isinstance(stats.min_raw, int):
            low = stats.min_raw if low is None else min(low, stats.min_raw)
            high = stats.max_raw if high is None else max(high, stats.max_raw)
        elif stats is None or not stats.has_null_count or stats.null_count < chunk.num_values:
            return None  # values there, and nothing says which
    return (0, 0) if low is None or high is None else (low, high)  # (nulls only: they fit)


def _stored_unit(leaf: pq.ColumnSchema, have: pa.DataType) -> str:
    """The unit of the leaf's stored integers: its Parquet timestamp type's (pyarrow stores
    timestamp[s] as ms), else (a duration, stored as plain int64) its Arrow type's."""
    if leaf.logical_type.type == "TIMESTAMP":
        unit = json.loads(leaf.logical_type.to_json()).get("timeUnit")
        return _PARQUET_UNITS.get(unit, have.unit)
    return have.unit


def _shown(raw: int, unit: str, have: pa.DataType) -> str:
    if pa.types.is_duration(have):
        return f"{raw} {unit}"
    stored = pa.array([raw], pa.int64()).view(pa.timestamp(unit, have.tz))
    return stored.cast(pa.string())[0].as_py()
