"""One Parquet schema per job, fixed before its first shard.

    id      text    finish_reason  prompt_tokens  completion_tokens  [prompt_logprobs]  [logprobs]
    string  string  string         int64          int64              list<struct>       list<struct>
                                                                     when the job asks for them

    then <passthrough columns>, one type each per job.

Every shard of a job is written with exactly this schema (an empty shard too), so the shards
read back as one dataset with pyarrow, duckdb or Spark and no options. The passthrough types
come from the input (``readers/passthrough_types.py``): a Parquet input's own schema, or, for
JSONL and OpenAI Batch input, Arrow's inference over a sample of rows. A column whose sample
gives no usable type (only nulls, values of no common type, an empty object or list) is
**JSON text**: a string column holding each value's JSON encoding, strings included, so that
``json.loads`` reads any cell back.

A value that does not fit its column (2.5 or "a" in an int64 column, an object with a key
the struct lacks) is its row's error (``row_problem``, ``column``), naming the column; the
column's type never changes. The schema travels in the manifest (``to_record`` /
``from_record``), so a resumed job writes the schema its first run fixed. The
``prompt_logprobs`` column (``prompt_logprobs_column.py``) is there when the job's sampling
section asks for prompt logprobs (``with_prompt_logprobs``), the ``logprobs`` column
(``logprobs_column.py``) when it asks for the completions' (``with_logprobs``); each is told
from a passthrough column of its name by its field metadata.
"""

from __future__ import annotations

import base64
import datetime
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.io.logprobs_column import LOGPROBS, LOGPROBS_FIELD
from tokenmill.io.prompt_logprobs_column import PROMPT_LOGPROBS, PROMPT_LOGPROBS_FIELD

__all__ = [
    "FIXED_COLUMNS",
    "FIXED_SCHEMA",
    "OutputSchema",
    "inferred_field",
    "json_default",
    "strict_json",
    "json_text_field",
    "storable_type",
    "zones_in_utc",
]

FIXED_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
    ]
)
FIXED_COLUMNS = tuple(FIXED_SCHEMA.names)

# Field metadata marking a JSON-text column: it is in the written files too, so a reader can
# tell which string columns to json.loads.
_ENCODING = b"tokenmill.encoding"
_JSON = b"json"
_REPR_LIMIT = 60
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# What Arrow raises (besides its own errors) for a Python value it cannot convert.
_CONVERSION_ERRORS = (pa.ArrowException, TypeError, ValueError, OverflowError)
# The columns between the fixed and the passthrough ones, in this order, each there when
# the job.yaml key beside it is set.
_LOGPROB_COLUMNS = (
    (PROMPT_LOGPROBS_FIELD, "sampling.prompt_logprobs"),
    (LOGPROBS_FIELD, "sampling.logprobs"),
)


def json_text_field(name: str) -> pa.Field:
    """A JSON-text column: strings holding each value's JSON encoding."""
    return pa.field(name, pa.string(), metadata={_ENCODING: _JSON})


def strict_json(value: Any) -> str:
    """``value`` as JSON text every parser takes: NaN and infinities (which Python's json
    writes as the bare tokens NaN / Infinity, refused by strict parsers, polars and Spark's
    FAILFAST mode) become null; bytes, dates, decimals as ``json_default`` gives them."""
    try:
        return json.dumps(value, ensure_ascii=False, default=json_default, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), ensure_ascii=False, default=json_default)


def _finite(value: Any) -> Any:
    """``value`` with its non-finite floats (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (bytes, bytearray, memoryview)):
        return _finite(value.tolist())  # numpy scalars and arrays
    return value


def json_default(value: Any) -> Any:
    """Values JSON lacks, as Parquet inputs hand them over: bytes, dates, decimals,
    durations (ISO 8601 seconds, ``PT90.5S``, ``-PT5S``, whatever their unit: pyarrow hands
    over ``datetime.timedelta`` for some units and pandas' ``Timedelta`` for ns)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, datetime.timedelta):
        return _duration_text(value)
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    return str(value)


def _duration_text(value: datetime.timedelta) -> str:
    nanos = getattr(value, "value", None)  # pandas' Timedelta: nanoseconds
    if not isinstance(nanos, int):
        nanos = ((value.days * 86400 + value.seconds) * 10**6 + value.microseconds) * 1000
    sign, (seconds, fraction) = "-" if nanos < 0 else "", divmod(abs(nanos), 10**9)
    decimals = f".{fraction:09d}".rstrip("0") if fraction else ""
    return f"{sign}PT{seconds}{decimals}S"


def inferred_field(name: str, values: Iterable[Any]) -> pa.Field:
    """The column ``name`` for ``values`` (a sample): Arrow's inferred type, or JSON text when
    the sample has no usable one (no non-null value, no common type, a null or empty nested
    type that later values could not fill, a type Parquet cannot store, a struct with field
    names equal but for case: duckdb renames the second, ``A`` to ``A_1``, and then reads
    ``meta.A`` as the value of ``meta.a``). Every value of the sample fits the type given."""
    present = [v for v in values if v is not None]
    if not present:
        return json_text_field(name)
    try:
        inferred = pa.array(present).type
    except _CONVERSION_ERRORS:
        return json_text_field(name)
    if _has_unknown_part(inferred) or _has_case_twins(inferred) or not storable_type(inferred):
        return json_text_field(name)
    column = pa.field(name, inferred)
    # Arrow's inference is looser than the column's fit check: [1.5, True] gives double
    # (True as 1.0), and the sampled rows holding a boolean would then be errors
    fits = _fit_check(column)
    if not all(fits(v) for v in present):
        return json_text_field(name)
    return column


def storable_type(dtype: pa.DataType) -> bool:
    """Whether Parquet can store a column of ``dtype`` (an empty struct it cannot) that
    pyarrow reads back (lists nested ~40 deep it writes but refuses to read: "Parquet schema
    too deeply nested")."""
    try:
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"c": pa.array([], type=dtype)}), sink)
        pq.read_table(pa.BufferReader(sink.getvalue()))
    except (pa.ArrowException, TypeError, ValueError, OSError, NotImplementedError):
        return False
    return True


@dataclass(frozen=True)
class OutputSchema:
    """The Parquet schema of a job's data files: ``FIXED_SCHEMA``, the ``prompt_logprobs``
    and ``logprobs`` columns when the job asks for them, then its passthrough columns.
    ``origin`` says where the passthrough types came from, for messages."""

    schema: pa.Schema
    origin: str = ""
    # (passthrough column, whether a value fits it), built once: rows are checked one by one
    _checks: tuple[tuple[pa.Field, Callable[[Any], bool]], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        first = len(FIXED_COLUMNS) + len(_logprob_columns(self.schema))
        passthrough = list(self.schema)[first:]
        object.__setattr__(self, "_checks", tuple((f, _fit_check(f)) for f in passthrough))

    @classmethod
    def of(cls, passthrough: Sequence[pa.Field], origin: str = "") -> OutputSchema:
        """Raises ValueError naming a passthrough column that repeats or clashes with a fixed
        column."""
        seen: set[str] = set()
        for f in passthrough:
            if f.name in FIXED_COLUMNS:
                raise ValueError(
                    f"passthrough column {f.name!r} clashes with the output column of the same "
                    "name; drop it from input.passthrough_columns or rename it"
                )
            if f.name in seen:
                raise ValueError(f"passthrough column {f.name!r} is named twice")
            seen.add(f.name)
        return cls(pa.schema([*FIXED_SCHEMA, *passthrough]), origin)

    @classmethod
    def inferred(cls, passthrough: Sequence[dict[str, Any]], origin: str = "") -> OutputSchema:
        """The schema inferred from rows' passthrough dicts (columns in first-seen order)."""
        names: dict[str, None] = {}
        for values in passthrough:
            names.update(dict.fromkeys(values))
        fields = [inferred_field(n, (p.get(n) for p in passthrough)) for n in names]
        return cls.of(fields, origin)

    def with_prompt_logprobs(self) -> OutputSchema:
        """This schema with the ``prompt_logprobs`` column (itself when it has it). Raises
        ValueError when a passthrough column has that name."""
        return self._with_column(PROMPT_LOGPROBS_FIELD)

    def with_logprobs(self) -> OutputSchema:
        """This schema with the ``logprobs`` column (itself when it has it). Raises
        ValueError when a passthrough column has that name."""
        return self._with_column(LOGPROBS_FIELD)

    @property
    def has_prompt_logprobs(self) -> bool:
        """Whether the data files have the ``prompt_logprobs`` column."""
        return PROMPT_LOGPROBS in _logprob_columns(self.schema)

    @property
    def has_logprobs(self) -> bool:
        """Whether the data files have the ``logprobs`` column."""
        return LOGPROBS in _logprob_columns(self.schema)

    def _with_column(self, column: pa.Field) -> OutputSchema:
        present = _logprob_columns(self.schema)
        if column.name in present:
            return self
        if any(f.name == column.name for f in self.passthrough):
            key = next(k for c, k in _LOGPROB_COLUMNS if c is column)
            raise ValueError(
                f"input.passthrough_columns: {column.name!r} clashes with the output column "
                f"of that name ({key} is set); rename it in the input or leave it out"
            )
        wanted = [c for c, _ in _LOGPROB_COLUMNS if c.name in present or c is column]
        return OutputSchema(pa.schema([*FIXED_SCHEMA, *wanted, *self.passthrough]), self.origin)

    @property
    def passthrough(self) -> list[pa.Field]:
        return [f for f, _ in self._checks]

    def is_json_text(self, name: str) -> bool:
        return _is_json_text(self.schema.field(name))

    def row_problem(
        self, passthrough: dict[str, Any], skip: frozenset[str] = frozenset()
    ) -> str | None:
        """Why a row's passthrough values do not fit the schema (the first column that does
        not), or None. Columns in ``skip`` are known to fit (their input has the same type)."""
        for f, fits in self._checks:
            if f.name in skip:
                continue
            value = passthrough.get(f.name)
            if not fits(value):
                return self._misfit(f, value)
        return None

    def column(self, name: str, values: list[Any], row_ids: list[str]) -> pa.Array:
        """Column ``name`` of a shard, one value per row. Raises ValueError naming the row and
        the column when a value does not fit the column's type."""
        f, fits = next((f, fits) for f, fits in self._checks if f.name == name)
        if _is_json_text(f):
            return pa.array([_json_text(v) for v in values], type=pa.string())
        try:
            array = pa.array(values, type=f.type)
        except _CONVERSION_ERRORS:
            array = None  # find the row to blame, one value at a time
        if array is None and all(fits(v) for v in values):
            # integers past int64 where doubles go (JSON's 1e20 written as 100000000000000000000):
            # Arrow refuses them as Python ints, not as the exact doubles they are
            try:
                array = pa.array([_wide_ints_as_floats(v) for v in values], type=f.type)
            except _CONVERSION_ERRORS:
                array = None
        back = _in_python(array) if array is not None else None
        for i, value in enumerate(values):
            if (not _same(value, back[i])) if back is not None else not fits(value):
                raise ValueError(f"row {row_ids[i]!r}: {self._misfit(f, value)}")
        if array is None:
            raise ValueError(f"passthrough column {name!r} cannot be written as {f.type}")
        return array

    def describe(self) -> dict[str, str]:
        """{passthrough column: its type, or "json text"}"""
        return {f.name: "json text" if _is_json_text(f) else str(f.type) for f in self.passthrough}

    def to_record(self) -> dict[str, Any]:
        """A JSON-able record of the schema (the manifest's ``output_schema``)."""
        return {
            "origin": self.origin,
            "passthrough": self.describe(),
            "arrow": base64.b64encode(self.schema.serialize().to_pybytes()).decode("ascii"),
        }

    @classmethod
    def from_record(cls, raw: Any) -> OutputSchema:
        """The schema ``to_record`` wrote. Raises ValueError when ``raw`` is not one."""
        try:
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(raw["arrow"])))
            origin = str(raw.get("origin", ""))
        except (TypeError, KeyError, ValueError, AttributeError, pa.ArrowException) as exc:
            raise ValueError(f"output_schema is not a recorded schema ({exc})") from None
        if list(schema)[: len(FIXED_COLUMNS)] != list(FIXED_SCHEMA):
            raise ValueError(f"output_schema does not start with the columns {FIXED_COLUMNS}")
        return cls(schema, origin)

    def _misfit(self, f: pa.Field, value: Any) -> str:
        origin = f" ({self.origin})" if self.origin else ""
        return (
            f"passthrough column {f.name!r} holds {_short(value)}, which does not fit the "
            f"column's type {f.type}{origin}; one schema holds for the whole job: fix the "
            f"value, or leave {f.name!r} out of input.passthrough_columns"
        )


def _logprob_columns(schema: pa.Schema) -> list[str]:
    """The names of the logprob columns ``schema`` has after its fixed ones (in the order of
    ``_LOGPROB_COLUMNS``: a column is one by its name, type and metadata)."""
    names: list[str] = []
    at = len(FIXED_COLUMNS)
    for column, _ in _LOGPROB_COLUMNS:
        if at < len(schema) and schema.field(at).equals(column, check_metadata=True):
            names.append(column.name)
            at += 1
    return names


# -- values against types ------------------------------------------------------------------


def _is_json_text(f: pa.Field) -> bool:
    return (f.metadata or {}).get(_ENCODING) == _JSON


def _json_text(value: Any) -> str | None:
    """``value``'s JSON text; None (a null cell) for None and for a NaN or infinity, which
    JSON writes as null (the text "null" in a cell would hide it from ``IS NULL``)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return strict_json(value)


def _wide_ints_as_floats(value: Any) -> Any:
    """``value`` with its integers outside int64 (at any depth) as floats."""
    if _is_int(value) and not _INT64_MIN <= value <= _INT64_MAX:
        return float(value)
    if isinstance(value, dict):
        return {k: _wide_ints_as_floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_wide_ints_as_floats(v) for v in value]
    return value


def _has_unknown_part(dtype: pa.DataType) -> bool:
    """Whether ``dtype`` is or holds the null type or an empty struct: types a sample of
    nulls and empty values gives, which later values could not fill."""
    return _any_part(
        dtype, lambda t: pa.types.is_null(t) or (pa.types.is_struct(t) and t.num_fields == 0)
    )


def _has_case_twins(dtype: pa.DataType) -> bool:
    """Whether ``dtype`` is or holds a struct with two field names equal but for case."""

    def twins(t: pa.DataType) -> bool:
        names = [f.name.casefold() for f in t] if pa.types.is_struct(t) else []
        return len(set(names)) < len(names)

    return _any_part(dtype, twins)


def _any_part(dtype: pa.DataType, test: Callable[[pa.DataType], bool]) -> bool:
    """Whether ``test`` holds for ``dtype`` or any type nested in it (struct fields, map
    keys and items, list values)."""
    if test(dtype):
        return True
    if pa.types.is_struct(dtype):
        inner = [f.type for f in dtype]
    elif pa.types.is_map(dtype):
        inner = [dtype.key_type, dtype.item_type]
    elif (
        pa.types.is_list(dtype)
        or pa.types.is_large_list(dtype)
        or pa.types.is_fixed_size_list(dtype)
    ):
        inner = [dtype.value_type]
    else:
        inner = []
    return any(_any_part(t, test) for t in inner)


def _fit_check(f: pa.Field) -> Callable[[Any], bool]:
    """Whether a value is stored in column ``f`` as it is: converted without error and read
    back equal (Arrow itself would store 2.5 in an int64 column as 2). None fits anywhere."""
    if _is_json_text(f):
        return lambda value: True
    quick = _python_check(f.type)
    if quick is not None:
        return lambda value: value is None or quick(value)
    dtype = f.type

    def through_arrow(value: Any) -> bool:
        if value is None:
            return True
        try:
            back = _in_python(pa.array([value], type=dtype))[0]
        except _CONVERSION_ERRORS:
            return False
        return _same(value, back)

    return through_arrow


def _in_python(array: pa.Array) -> list[Any]:
    """``array``'s values in Python, zoned timestamps in UTC (``zones_in_utc``)."""
    return zones_in_utc(array).to_pylist()


def zones_in_utc(array: pa.Array) -> pa.Array:
    """``array``, a zoned timestamp one cast to UTC: the same instants (which compare equal
    in Python), whose local times Python holds where it may not hold the zone's
    (9999-12-31T23:59:59Z, the usual open end, is in year 10000 in Berlin)."""
    if pa.types.is_timestamp(array.type) and array.type.tz is not None:
        return array.cast(pa.timestamp(array.type.unit, "UTC"))
    return array


def _python_check(dtype: pa.DataType) -> Callable[[Any], bool] | None:
    """The fit check in plain Python for the types JSON values are inferred as (strings,
    booleans, int64, double, and lists and structs of them: most rows, so no Arrow call per
    row); None for any other type, which goes through Arrow."""
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return lambda v: isinstance(v, str)
    if pa.types.is_boolean(dtype):
        return lambda v: isinstance(v, bool)
    if pa.types.is_int64(dtype):
        return lambda v: _is_int(v) and _INT64_MIN <= v <= _INT64_MAX
    if pa.types.is_float64(dtype):
        return lambda v: isinstance(v, float) or (_is_int(v) and _exact_double(v))
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        item = _python_check(dtype.value_type)
        if item is None:
            return None
        return lambda v: isinstance(v, (list, tuple)) and all(x is None or item(x) for x in v)
    if pa.types.is_struct(dtype):
        fields = {f.name: _python_check(f.type) for f in dtype}
        if any(check is None for check in fields.values()):
            return None
        # a key the struct lacks does not fit: Arrow would drop it
        return lambda v: (
            isinstance(v, dict)
            and all(k in fields and (x is None or fields[k](x)) for k, x in v.items())
        )
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _exact_double(value: int) -> bool:
    try:
        return int(float(value)) == value
    except OverflowError:
        return False


def _same(value: Any, back: Any) -> bool:
    """Whether ``back`` (read from Arrow) is ``value``: numbers by value (3 and 3.0 alike,
    NaN as NaN), booleans only as booleans, a struct's missing keys as nulls, maps as pairs."""
    if value is None or back is None:
        return value is back
    if isinstance(value, bool) or isinstance(back, bool):
        return type(value) is type(back) and value == back
    if isinstance(value, (int, float)) and isinstance(back, (int, float)):
        if isinstance(value, float) and isinstance(back, float) and math.isnan(value):
            return math.isnan(back)
        return value == back
    if isinstance(value, dict):
        if isinstance(back, list):  # a map column reads back as (key, value) pairs
            back = dict(back) if len(back) == len(value) else None
        if not isinstance(back, dict):
            return False
        return all(k in back and _same(v, back[k]) for k, v in value.items()) and all(
            v is None for k, v in back.items() if k not in value
        )
    if isinstance(value, (list, tuple)):
        return (
            isinstance(back, (list, tuple))
            and len(back) == len(value)
            and all(_same(v, b) for v, b in zip(value, back, strict=True))
        )
    if isinstance(value, str) or isinstance(back, str):
        return type(value) is type(back) and value == back
    try:
        return bool(value == back)
    except Exception:  # a value whose == raises (numpy arrays compare elementwise)
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."
