"""Shard serialization: result rows to a shard file's bytes, written to a file as they are
made (``write_results``: a shard's data file is never held in memory whole) or returned.

    shard k ──► shards/part-<k:05d>.parquet | .jsonl   the good rows (write_results)
           └──► errors/part-<k:05d>.jsonl              the failed rows (encode_errors), written
                                                       only when the shard has any

Data rows (parquet, jsonl) have the columns ``id, text, finish_reason, prompt_tokens,
completion_tokens``, then ``prompt_logprobs`` and ``logprobs`` for rows that asked for them
(Parquet: in every row when the job's schema has the column; see prompt_logprobs_column.py
and logprobs_column.py), then the passthrough columns, each under its own name. Parquet files
are written with the job's one ``OutputSchema`` (fixed columns and passthrough types alike),
so every shard of a job, empty ones included, reads back as one dataset, in row groups of
about ``ROW_GROUP_BYTES`` of values (one row at least). Error files are JSONL
in every format. Rows are written in ``row_index`` order, whatever order they finished in:
the same results give the same bytes, so a recomputed shard is identical to the one a crash
interrupted.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.io.logprobs_column import LOGPROBS, LOGPROBS_FIELD
from tokenmill.io.openai_batch_output import error_line, result_line
from tokenmill.io.output_schema import FIXED_COLUMNS, FIXED_SCHEMA, OutputSchema, strict_json
from tokenmill.io.prompt_logprobs_column import PROMPT_LOGPROBS, PROMPT_LOGPROBS_FIELD
from tokenmill.io.rows import ResultRow
from tokenmill.io.storage import OutputStore
from tokenmill.io.value_bytes import value_bytes

__all__ = [
    "FIXED_COLUMNS",
    "OUTPUT_FORMATS",
    "ROW_GROUP_BYTES",
    "encode_errors",
    "encode_results",
    "read_results",
    "shard_index",
    "shard_names",
    "write_results",
]

OUTPUT_FORMATS = ("parquet", "jsonl", "openai-batch")
# A Parquet row group's values, about (value_bytes): writing one holds the group's Arrow
# columns and encoded pages beside the rows. Shards under it are one row group, as before.
ROW_GROUP_BYTES = 64 << 20


def _check_format(fmt: str) -> None:
    if fmt not in OUTPUT_FORMATS:
        raise ValueError(f"output.format {fmt!r} is not one of {', '.join(OUTPUT_FORMATS)}")


def shard_names(index: int, fmt: str) -> tuple[str, str]:
    """(data file, error file) of shard ``index``, e.g.
    ``("shards/part-00000.parquet", "errors/part-00000.jsonl")``.

    Zero-padded to 5 digits, wider past 99,999 (so plain sorting follows shard order up to
    100,000 shards; ``shard_index`` parses the number back for anything larger).
    """
    _check_format(fmt)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"shard index must be an int >= 0, got {index!r}")
    ext = "parquet" if fmt == "parquet" else "jsonl"
    return f"shards/part-{index:05d}.{ext}", f"errors/part-{index:05d}.jsonl"


def shard_index(name: str) -> int:
    """The shard number in a name made by ``shard_names``; ValueError for other names."""
    base = name.rsplit("/", 1)[-1]
    stem = base.split(".", 1)[0]
    if not stem.startswith("part-") or not stem[5:].isdigit():
        raise ValueError(f"{name!r} is not a shard file name (expected part-<number>.<ext>)")
    return int(stem[5:])


def encode_results(
    rows: list[ResultRow], fmt: str, created: int = 0, schema: OutputSchema | None = None
) -> bytes:
    """The bytes ``write_results`` writes, for a few rows (a shard's are written to a file)."""
    out = io.BytesIO()
    write_results(rows, fmt, out, created, schema)
    return out.getvalue()


def write_results(
    rows: list[ResultRow],
    fmt: str,
    out: BinaryIO,
    created: int = 0,
    schema: OutputSchema | None = None,
) -> None:
    """Write to ``out`` the data file of a shard holding the good rows of ``rows`` (failed
    rows are skipped: pass the same list to ``encode_errors``), a line or a row group at a
    time; on an error, ``out`` holds part of it. ``created`` is the OpenAI ``created`` field
    (openai-batch only). ``schema`` is the job's Parquet schema (parquet only; None: inferred
    from these rows alone, which another shard's rows may not share). Raises ValueError for an
    unknown format, a passthrough column that clashes with an output column or is not in
    ``schema``, a passthrough value that does not fit its column's type (naming the row and
    column), a row with prompt or completion logprobs for a ``schema`` without their column,
    or an openai-batch row without a supported endpoint."""
    _check_format(fmt)
    good = _in_order(r for r in rows if r.ok)
    if fmt == "parquet":
        if schema is None:
            schema = OutputSchema.inferred([r.passthrough for r in good])
            if any(r.prompt_logprobs is not None for r in good):
                schema = schema.with_prompt_logprobs()
            if any(r.logprobs is not None for r in good):
                schema = schema.with_logprobs()
        _write_parquet(good, schema, out)
    elif fmt == "jsonl":
        _write_jsonl((_plain_record(r) for r in good), out)
    else:
        _write_jsonl((result_line(r, created) for r in good), out)


def encode_errors(rows: list[ResultRow], fmt: str) -> bytes:
    """The error file (JSONL) of a shard holding the failed rows of ``rows``: ``{"id",
    "error"}`` per line, or OpenAI Batch error objects for openai-batch."""
    _check_format(fmt)
    failed = _in_order(r for r in rows if not r.ok)
    if fmt == "openai-batch":
        return _jsonl_bytes(error_line(r) for r in failed)
    return _jsonl_bytes({"id": r.row_id, "error": r.error} for r in failed)


def read_results(store: OutputStore, names: list[str], fmt: str) -> list[dict[str, Any]]:
    """Read shard files (data or error files) back as dicts, in the order of ``names``.

    ``.parquet`` files are read with pyarrow, everything else as JSONL. Raises
    FileNotFoundError naming the file when one is missing.
    """
    _check_format(fmt)
    out: list[dict[str, Any]] = []
    for name in names:
        data = store.read_bytes(name)
        if data is None:
            raise FileNotFoundError(f"{store.path(name)}: shard file not found")
        if name.endswith(".parquet"):
            out.extend(pq.read_table(pa.BufferReader(data)).to_pylist())
        else:
            out.extend(_read_jsonl(data, store.path(name)))
    return out


# -- plain rows --------------------------------------------------------------------------------


def _in_order(rows: Any) -> list[ResultRow]:
    return sorted(rows, key=lambda r: r.row_index)


def _plain_record(row: ResultRow) -> dict[str, Any]:
    if len(row.choices) > 1:  # the executor refuses such rows first; never drop choices
        raise ValueError(
            f"row {row.row_id!r} has {len(row.choices)} completions (n > 1); plain output "
            "holds one text per row: use output.format: openai-batch"
        )
    record: dict[str, Any] = {
        "id": row.row_id,
        "text": row.text,
        "finish_reason": row.finish_reason,
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
    }
    if row.prompt_logprobs is not None:
        record[PROMPT_LOGPROBS] = row.prompt_logprobs
    if row.logprobs is not None:  # the row's one completion's (n > 1 was refused above)
        record[LOGPROBS] = row.logprobs
    for key, value in row.passthrough.items():
        if key in record:
            raise ValueError(
                f"row {row.row_id!r}: passthrough column {key!r} clashes with the output column "
                f"of the same name; drop it from input.passthrough_columns or rename it"
            )
        record[key] = value
    return record


def _write_parquet(rows: list[ResultRow], schema: OutputSchema, out: BinaryIO) -> None:
    with pq.ParquetWriter(out, schema.schema) as writer:
        for group in _row_groups(rows):
            writer.write_table(_parquet_table(group, schema))


def _row_groups(rows: list[ResultRow]) -> Iterator[list[ResultRow]]:
    """``rows`` in consecutive groups of at most ``ROW_GROUP_BYTES`` of values, one row at
    least; one empty group for no rows (``pq.write_table`` writes one for an empty table)."""
    group: list[ResultRow] = []
    size = 0
    for row in rows:
        weight = value_bytes((row.text, row.passthrough, row.prompt_logprobs, row.logprobs))
        if group and size + weight > ROW_GROUP_BYTES:
            yield group
            group, size = [], 0
        group.append(row)
        size += weight
    yield group


def _parquet_table(rows: list[ResultRow], schema: OutputSchema) -> pa.Table:
    records = [_plain_record(r) for r in rows]  # raises for a clash with a fixed column
    known = set(schema.schema.names)
    for row in rows:
        extra = sorted(set(row.passthrough) - known)
        if extra:
            raise ValueError(
                f"row {row.row_id!r}: passthrough column {extra[0]!r} is not in the job's "
                f"output schema (columns: {', '.join(schema.schema.names)})"
            )
    row_ids = [r.row_id for r in rows]
    columns = [pa.array([rec[f.name] for rec in records], type=f.type) for f in FIXED_SCHEMA]
    prompt_logprobs = [r.prompt_logprobs for r in rows]
    columns += _entries_column(
        PROMPT_LOGPROBS_FIELD,
        schema.has_prompt_logprobs,
        prompt_logprobs,
        row_ids,
        "prompt logprobs",
    )
    logprobs = [r.logprobs for r in rows]
    columns += _entries_column(LOGPROBS_FIELD, schema.has_logprobs, logprobs, row_ids, "logprobs")
    for f in schema.passthrough:
        values = [r.passthrough.get(f.name) for r in rows]
        columns.append(schema.column(f.name, values, row_ids))
    return pa.Table.from_arrays(columns, schema=schema.schema)


def _entries_column(
    column: pa.Field, in_schema: bool, values: list[Any], row_ids: list[str], what: str
) -> list[pa.Array]:
    """``[column]`` of a shard (rows without entries hold null) when the job's schema has it,
    else ``[]``. Raises ValueError naming the first row with entries when the schema lacks the
    column: they are never dropped."""
    if in_schema:
        return [pa.array(values, type=column.type)]
    asked = next((i for i, v in enumerate(values) if v is not None), None)
    if asked is not None:  # the job's schema was fixed without the column
        raise ValueError(
            f"row {row_ids[asked]!r} has {what}, but the job's Parquet schema has no "
            f"{column.name} column; set sampling.{column.name} in the job spec"
        )
    return []


# -- JSONL ---------------------------------------------------------------------------------


# Characters JSON leaves raw inside strings but Python's str.splitlines (and other line
# readers) take as line breaks: escaped, so every record stays on one line for every reader.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _jsonl_bytes(records: Iterable[Any]) -> bytes:
    out = io.BytesIO()
    _write_jsonl(records, out)
    return out.getvalue()


def _write_jsonl(records: Iterable[Any], out: BinaryIO) -> None:
    for rec in records:  # a line at a time: a shard's lines are never all held at once
        out.write(strict_json(rec).translate(_LINE_BREAKS).encode("utf-8"))
        out.write(b"\n")


def _read_jsonl(data: bytes, where: str) -> list[dict[str, Any]]:
    out = []
    for lineno, line in enumerate(data.decode("utf-8").split("\n"), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}:{lineno}: not valid JSON ({exc})") from None
    return out
