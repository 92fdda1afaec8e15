"""The types of a job's passthrough columns, decided once from its input, before any shard.

    Parquet input  ─► every file's schema (footers only) ─► one type per column: the files'
                      types unified as Arrow promotes them (null -> double, int32 -> int64;
                      an integer beside a decimal: a decimal128 holding both, else refused);
                      dictionary columns as their values, extension types as their storage
                      (but UUIDs, which Parquet stores as they are); a timestamp or duration
                      combined into a finer unit (ms beside ns) refused unless the coarser
                      files' footer statistics say each value fits (parquet_time_ranges.py)
    JSONL / OpenAI Batch input ─► the passthrough values of the good rows among the first
                      rows of each file (``REMOTE_SAMPLED_FILES`` of a remote input's,
                      spread), ``SAMPLE_ROWS`` in all shared among the files (a
                      row of each at least; fewer once the values kept hold ``SAMPLE_BYTES``;
                      a long text kept as an empty one, of its type) ─► Arrow's inference
                      (``inferred_field``: JSON text where the sample has no usable type)

The types are then fixed for the job (``OutputSchema``): a later value that does not fit is
its row's error (``iter_input_rows(cfg, schema)``), never a change of the column's type.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from tokenmill.io.nested_types import with_child_types
from tokenmill.io.output_schema import (
    OutputSchema,
    inferred_field,
    json_text_field,
    storable_type,
)
from tokenmill.io.readers.file_listing import list_input_files
from tokenmill.io.readers.format_detection import input_format
from tokenmill.io.readers.input_config import InputConfig
from tokenmill.io.readers.input_rows import iter_input_rows
from tokenmill.io.readers.parquet_footers import footer_of
from tokenmill.io.readers.parquet_records import ParquetRecords
from tokenmill.io.readers.parquet_time_ranges import has_finer_units, unit_overflow
from tokenmill.io.readers.storage import resolve
from tokenmill.io.value_bytes import value_bytes

__all__ = ["SAMPLE_ROWS", "passthrough_schema"]

log = logging.getLogger("tokenmill.jobs")

# Rows whose values decide a JSONL input's passthrough types: large enough that a column that
# is sparse at the start still shows its type, small enough to read in a second or two.
SAMPLE_ROWS = 10_000
# The sample's bound in bytes: 10,000 rows of a 5 MB column were 50 GB (an audit; a 400-row
# input was read whole into memory before its first row ran).
SAMPLE_BYTES = 64 << 20
# A remote file's sample costs a request or more (~50 ms on S3), one file after another: a
# remote input of thousands of files is sampled at this many, spread over its list (the
# first and the last among them); a local input at every file (10,000 in ~2 s).
REMOTE_SAMPLED_FILES = 64
# The most digits a decimal128 holds; a decimal256's.
_DECIMAL128_DIGITS, _DECIMAL256_DIGITS = 38, 76
_LONG_TEXT = 64  # characters past which a text's type is all the sample keeps of it


def passthrough_schema(cfg: InputConfig) -> OutputSchema:
    """The output schema of a job reading ``cfg``: the fixed columns, then each of
    ``cfg.passthrough_columns`` with its type.

    Raises ValueError naming the column and two files when Parquet input files hold a
    passthrough column in types that do not combine (int64 and string), and what
    ``iter_input_rows`` raises for an input that cannot be read.
    """
    if not cfg.passthrough_columns:
        return OutputSchema.of([])
    files = list_input_files(cfg)
    fmt = input_format(cfg, files)
    if fmt == "parquet":
        origin = "the input's Parquet type, combined over its files"
        return OutputSchema.of(_parquet_fields(files, cfg), origin)
    return _sampled(cfg, files, fmt)


def _sampled(cfg: InputConfig, files: list[str], fmt: str) -> OutputSchema:
    """Types inferred from the first rows of each of ``files``: ``SAMPLE_ROWS`` and
    ``SAMPLE_BYTES`` shared among the files yet to be read, a row of each at least (once
    the first file alone filled the sample, a later file's other type made each of its rows
    an error), until the values kept hold ``SAMPLE_BYTES``."""
    columns = cfg.passthrough_columns
    values: dict[str, list[Any]] = {name: [] for name in columns}
    read = kept_bytes = sampled_files = 0
    chosen = _files_to_sample(files, cfg)
    ended = len(chosen) == len(files)  # every row of every file sampled
    for url in chosen:
        if kept_bytes >= SAMPLE_BYTES:
            ended = False
            break
        left = len(chosen) - sampled_files
        one = replace(cfg, files=(url,), files_format=fmt)
        rows_quota = max((SAMPLE_ROWS - read) // left, 1)
        bytes_quota = (SAMPLE_BYTES - kept_bytes) // left
        file_rows, file_bytes, whole = _sample_file(one, values, rows_quota, bytes_quota)
        read += file_rows
        kept_bytes += file_bytes
        sampled_files += 1
        ended = ended and whole
    if ended:
        which = f"all {read} input rows"
    elif len(files) == 1:
        which = f"the first {read} input rows"
    else:
        of = f" of {len(files)}" if sampled_files < len(files) else ""
        which = f"{read} input rows, the first of each of {sampled_files}{of} input files"
    fields = [inferred_field(name, values[name]) for name in columns]
    return OutputSchema.of(fields, f"inferred from {which}")


def _files_to_sample(files: list[str], cfg: InputConfig) -> list[str]:
    """Every file of a local input; of a remote one, ``REMOTE_SAMPLED_FILES`` spread evenly
    over the list, its first and last among them (sampled one after another, thousands of
    remote files would hold the job's start for minutes)."""
    if len(files) <= REMOTE_SAMPLED_FILES:
        return files
    fs, _ = resolve(files[0], cfg.storage_options)
    if isinstance(fs, LocalFileSystem):
        return files
    step = (len(files) - 1) / (REMOTE_SAMPLED_FILES - 1)
    return [files[round(i * step)] for i in range(REMOTE_SAMPLED_FILES)]


def _sample_file(
    cfg: InputConfig, values: dict[str, list[Any]], rows_quota: int, bytes_quota: int
) -> tuple[int, int, bool]:
    """Adds to ``values`` the passthrough values of the good rows among the first
    ``rows_quota`` rows of ``cfg``'s one file, fewer once they hold ``bytes_quota`` (a row
    at least); returns (rows read, bytes kept, whether every row of the file was read)."""
    read = kept_bytes = 0
    rows = iter_input_rows(cfg)
    try:
        for row in rows:
            if read == rows_quota or (read and kept_bytes >= bytes_quota):
                return read, kept_bytes, False
            read += 1
            if row.error is None:
                for name in values:
                    value = _kept(row.passthrough.get(name))
                    kept_bytes += value_bytes(value)
                    values[name].append(value)
    finally:
        rows.close()
    return read, kept_bytes, True


def _kept(value: Any) -> Any:
    """What the sample keeps of ``value``: a long text as an empty one (its type is all
    inference reads of it); other values as they are."""
    if isinstance(value, str | bytes) and len(value) > _LONG_TEXT:
        return value[:0]
    return value


def _parquet_fields(files: list[str], cfg: InputConfig) -> list[pa.Field]:
    found: dict[str, tuple[pa.DataType, str]] = {}  # column -> (its type, a file giving it)
    # (url, types, whether it has no rows): an empty file gives a type only where no file
    # with rows does (an empty Spark part file's string must not clash with int64 rows)
    schemas = []
    for url in files:  # (footers the run's checks or fingerprint read already: not again)
        footer = footer_of(url, cfg)
        schemas.append((url, footer.types, footer.num_rows == 0))
    schemas.sort(key=lambda s: s[2])
    for url, types, no_rows in schemas:
        for name in cfg.passthrough_columns:
            if name not in types or (no_rows and name in found):
                continue
            dtype = _plain(types[name])
            if name not in found:
                found[name] = (dtype, url)
                continue
            have, where = found[name]
            if dtype != have:
                found[name] = (_unified(name, have, where, dtype, url), where)
    _refuse_finer_units_that_overflow(schemas, {n: t for n, (t, _) in found.items()}, cfg)
    fields = []
    for name in cfg.passthrough_columns:
        if name in found and storable_type(found[name][0]):
            fields.append(pa.field(name, found[name][0]))
            continue
        if name in found:  # a type Parquet cannot store (list<uuid>, very deep lists)
            log.warning(
                "input.passthrough_columns %r: its type %s cannot be written to Parquet as it "
                "is, so its values are written as JSON text",
                name,
                found[name][0],
            )
        fields.append(json_text_field(name))  # else in no input file: every value is null
    absent = [n for n in cfg.passthrough_columns if n not in found]
    if absent:
        log.warning(
            "input.passthrough_columns %s: in none of the %d input files, so null in every "
            "output row (a misspelling? hive-style folder keys such as date=... are not read "
            "as columns)",
            ", ".join(repr(n) for n in absent),
            len(files),
        )
    return fields


def _refuse_finer_units_that_overflow(
    schemas: list[tuple[str, dict[str, pa.DataType], bool]],
    combined: dict[str, pa.DataType],
    cfg: InputConfig,
) -> None:
    """Raises ValueError where a file's timestamps or durations do not fit the finer unit
    their column was combined into (ms beside ns: ns holds only 1677-2262), or where its
    footer's statistics cannot tell. A coarser unit for the column is no way out: the finer
    file's values are whole units of the coarser one only by chance, which no footer says."""
    for url, types, no_rows in schemas:
        finer = {
            name: want
            for name, want in combined.items()
            if name in types and not no_rows and has_finer_units(types[name], want)
        }
        if not finer:
            continue
        with ParquetRecords(url, cfg.storage_options, []) as records:
            metadata, schema = records.footer()
        for name, want in finer.items():
            over = unit_overflow(metadata, schema, name, want)
            if over is None:
                continue
            finer_files = (
                (u, _plain(t[name]))
                for u, t, _ in schemas
                if name in t and has_finer_units(types[name], _plain(t[name]))
            )
            other, its = next(finer_files, ("another input file", want))
            what = (
                f"holds {over.value} there"
                if over.value is not None
                else "has no min/max statistics for it, so whether its values fit is unknown"
            )
            raise ValueError(
                f"input.passthrough_columns: column {name!r} is {types[name]} in {url} but "
                f"{its} in {other}, so its values would be written as {over.wanted}, which "
                f"holds {_span(over.wanted)}; {url} {what}, and its rows would be errors: cast "
                f"the column to {over.file_type} in {other} (pandas: "
                f".astype('{_numpy_name(over.file_type)}') before to_parquet), or leave it "
                "out of input.passthrough_columns"
            )


def _span(dtype: pa.DataType) -> str:
    """What ``dtype`` (a finer unit's timestamp or duration) holds, as a user reads it."""
    if dtype.unit == "ns":
        return "only the years 1677 to 2262" if pa.types.is_timestamp(dtype) else "only 292 years"
    return f"only what an int64 of {dtype.unit} holds"


def _numpy_name(dtype: pa.DataType) -> str:
    kind = "datetime64" if pa.types.is_timestamp(dtype) else "timedelta64"
    return f"{kind}[{dtype.unit}]"


def _plain(dtype: pa.DataType) -> pa.DataType:
    """The type a column's values are written back as: a dictionary's values, an extension
    type's storage, inside lists, structs and maps too (polars writes list<categorical> as
    list<dictionary>: beside a file's list<string> the two did not combine)."""
    if pa.types.is_dictionary(dtype):
        return _plain(dtype.value_type)
    if pa.types.is_string_view(dtype):  # (beside another file's string they did not combine)
        return pa.string()
    if pa.types.is_binary_view(dtype):
        return pa.binary()
    if isinstance(dtype, pa.BaseExtensionType):  # Arrow's own (bool8, uuid, ...) too
        if dtype.extension_name == "arrow.bool8":
            return pa.bool_()  # its values read as booleans, which int8 storage refuses
        if dtype.extension_name == "arrow.uuid":
            # kept: its values read as UUIDs, which its 16-byte storage refused (every row
            # of a job with DuckDB's or Spark's UUID column failed), and Parquet has a UUID
            # type of its own that readers know
            return dtype
        return _plain(dtype.storage_type)
    return with_child_types(dtype, _plain)


def _unified(name: str, have: pa.DataType, where: str, dtype: pa.DataType, url: str) -> pa.DataType:
    try:
        merged = pa.unify_schemas(
            [pa.schema([(name, have)]), pa.schema([(name, dtype)])], promote_options="permissive"
        )
        combined = _exact_decimals(merged.field(name).type, have, dtype)
        lossy = _lossy(have, combined) or _lossy(dtype, combined)
        if lossy:
            raise TypeError(lossy)
    except (pa.ArrowException, TypeError) as exc:
        raise ValueError(
            f"input.passthrough_columns: column {name!r} is {have} in {where} but {dtype} in "
            f"{url}, and the two do not combine into one type ({exc}); a job's output has one "
            "type per column: give the column one type in every input file, or leave it out "
            "of input.passthrough_columns"
        ) from None
    for side, file in ((have, where), (dtype, url)):
        if pa.types.is_integer(side) and side.bit_width > 32 and pa.types.is_floating(combined):
            log.warning(
                "input.passthrough_columns: column %r is %s in %s but %s in %s: written as %s, "
                "so a row of %s whose integer a double cannot hold exactly (past 2**53) is "
                "that row's error",
                name, have, where, dtype, url, combined, file,
            )  # fmt: skip
    return combined


def _exact_decimals(merged: pa.DataType, *sides: pa.DataType | None) -> pa.DataType:
    """``merged`` with each decimal in it (inside lists, structs and maps too) wide enough for
    the ``sides``' values there: Arrow counts an integer one digit short (int64 beside
    decimal128(10, 2) gave decimal128(20, 2), and each row past 10**18 was refused). Raises
    TypeError where that takes more than 38 digits and no side is a decimal256 already (a
    decimal256 column duckdb reads as double, rounding every value), or more than 76."""
    if pa.types.is_decimal(merged):
        return _exact_decimal(merged, [s for s in sides if s is not None])
    if pa.types.is_struct(merged):
        return pa.struct(
            [
                f.with_type(_exact_decimals(f.type, *(_field(s, f.name) for s in sides)))
                for f in merged
            ]
        )
    if pa.types.is_map(merged):
        maps = [s if s is not None and pa.types.is_map(s) else None for s in sides]
        key = _exact_decimals(merged.key_type, *(m.key_type if m else None for m in maps))
        item = _exact_decimals(merged.item_type, *(m.item_type if m else None for m in maps))
        return pa.map_(merged.key_field.with_type(key), merged.item_field.with_type(item))
    if hasattr(merged, "value_type") and not pa.types.is_dictionary(merged):  # lists
        values = [getattr(s, "value_type", None) for s in sides]
        return with_child_types(merged, lambda t: _exact_decimals(t, *values))
    return merged


def _exact_decimal(merged: pa.DataType, sides: list[pa.DataType]) -> pa.DataType:
    whole = max(_whole_digits(s) for s in sides)
    precision = max(whole + merged.scale, 1)
    if precision <= _DECIMAL128_DIGITS:
        return pa.decimal128(precision, merged.scale)
    if precision <= _DECIMAL256_DIGITS and any(pa.types.is_decimal256(s) for s in sides):
        return pa.decimal256(precision, merged.scale)
    raise TypeError(
        f"holding both takes {whole} digits before the point and {merged.scale} after it, "
        f"past a decimal128's {_DECIMAL128_DIGITS} (duckdb reads a decimal256 as double)"
    )


def _field(side: pa.DataType | None, name: str) -> pa.DataType | None:
    if side is not None and pa.types.is_struct(side) and side.get_field_index(name) >= 0:
        return side.field(name).type
    return None


def _whole_digits(dtype: pa.DataType) -> int:
    """Digits before the point that ``dtype``'s values take (an integer's widest, sign
    aside); 0 for a type without them (null)."""
    if pa.types.is_decimal(dtype):
        return dtype.precision - dtype.scale
    if pa.types.is_integer(dtype):
        unsigned = pa.types.is_unsigned_integer(dtype)
        widest = 2**dtype.bit_width - 1 if unsigned else 2 ** (dtype.bit_width - 1)  # -128
        return len(str(widest))
    return 0


def _lossy(side: pa.DataType, merged: pa.DataType) -> str | None:
    """Why ``side``'s values do not all fit ``merged``, the type Arrow combined it into
    (text into binary, uint64 past 2**63 into int64, decimals into double: every such row
    would be refused)."""
    if _is_text(side) and not _is_text(merged):
        return f"{side} values would be written as {merged}"
    if pa.types.is_uint64(side) and pa.types.is_int64(merged):
        return "uint64 values past 2**63 do not fit int64"
    if pa.types.is_decimal(side) and pa.types.is_floating(merged):
        # (0.10 is no double: every row holding a fraction was its row's error)
        return f"{side} values would be written as {merged}, which holds few decimals exactly"
    return None


def _is_text(dtype: pa.DataType) -> bool:
    return (
        pa.types.is_string(dtype)
        or pa.types.is_large_string(dtype)
        or pa.types.is_string_view(dtype)
    )
