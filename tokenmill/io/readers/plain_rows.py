"""Turning a plain JSONL/Parquet row (id + prompt or messages columns) into an InputRow.

A row may carry its own output constraint in ``input.structured_output_column``: null (the
job's ``sampling.structured_output``), ``"json_object"``, a one-key object
``{"json_schema": {...}}``, ``{"regex": "..."}`` or ``{"choice": ["a", "b"]}``, or that object
as JSON text (the form for Parquet, whose struct columns would pad every row's schema with
the other rows' keys). A bad one is that row's error, naming the column.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.chat_messages import conversation_cell
from tokenmill.engine.structured_output_params import structured_output_setting
from tokenmill.io.readers.input_config import DEFAULT_ID_COLUMN, InputConfig
from tokenmill.io.readers.messages import check_messages
from tokenmill.io.readers.row_error import RowError, type_name
from tokenmill.io.rows import InputRow


@dataclass(frozen=True)
class PlainColumns:
    """Which columns one file's rows are read from, decided once per file.

    ``id_column`` is None when the config has none, or only the default ``id`` and the file's
    data lacks it: then ids are the fallback ``"<file>:<line>"``, unless a row carries a
    usable id of its own (JSONL files, whose columns are judged from their first object). A
    column named in the config is every row's: a file without it (a renamed column, schema
    drift) has rows without ids, each an error, rather than file:line ids without a word.
    """

    id_column: str | None
    config_id_column: str | None
    prompt_column: str | None
    messages_column: str | None
    passthrough_columns: tuple[str, ...]
    columns_hint: str = ""  # the file's columns, for "no such column" messages
    structured_output_column: str | None = None

    @classmethod
    def for_file(cls, cfg: InputConfig, has_column: Any, columns_hint: str) -> PlainColumns:
        present = cfg.id_column is not None and has_column(cfg.id_column)
        return cls(
            id_column=cfg.id_column if present or cfg.id_column != DEFAULT_ID_COLUMN else None,
            config_id_column=cfg.id_column,
            prompt_column=cfg.prompt_column if cfg.messages_column is None else None,
            messages_column=cfg.messages_column,
            passthrough_columns=cfg.passthrough_columns,
            columns_hint=columns_hint,
            structured_output_column=cfg.structured_output_column,
        )


def parse_plain_row(
    value: Any, *, columns: PlainColumns, row_index: int, source: str, fallback_id: str
) -> InputRow:
    """The InputRow for one plain row, or RowError saying what is wrong with it."""
    row_id = plain_row_id(value, columns=columns, fallback_id=fallback_id)
    passthrough = {name: value.get(name) for name in columns.passthrough_columns}
    sampling = _row_sampling(value, columns, row_id)
    if columns.messages_column is not None:
        if columns.messages_column not in value:
            raise RowError(_missing_column(value, columns, columns.messages_column), row_id)
        cell = value.get(columns.messages_column)
        if isinstance(cell, bytes):  # JSON text in a BINARY column, as a prompt's may be
            cell = _utf8(cell, columns.messages_column, row_id, "messages")
        messages = check_messages(
            conversation_cell(cell), f"column {columns.messages_column!r}", row_id
        )
        return InputRow(
            row_index, row_id, source, messages=messages, sampling=sampling, passthrough=passthrough
        )
    assert columns.prompt_column is not None  # InputConfig.check_plain_columns guarantees it
    prompt = value.get(columns.prompt_column)
    if isinstance(prompt, bytes):  # a Parquet BINARY column that is text (Impala, old Hive
        prompt = _utf8(prompt, columns.prompt_column, row_id)  # and Spark write them so)
    if not isinstance(prompt, str) or not prompt:
        raise RowError(_missing_prompt(value, columns), row_id)
    return InputRow(
        row_index, row_id, source, prompt=prompt, sampling=sampling, passthrough=passthrough
    )


def _row_sampling(value: dict[str, Any], columns: PlainColumns, row_id: str) -> dict[str, Any]:
    """The row's SamplingParams overrides: its own ``structured_output``, if it has one."""
    name = columns.structured_output_column
    if name is None:
        return {}
    cell = value.get(name)
    if isinstance(cell, dict):  # a Parquet struct column: every field, null where unset
        cell = {k: v for k, v in cell.items() if v is not None} or None
    if cell is None or cell == "" or (isinstance(cell, float) and math.isnan(cell)):
        return {}
    try:
        canonical = structured_output_setting(cell)
    except (ValueError, ImportError) as exc:
        raise RowError(f"column {name!r}: {exc}", row_id) from None
    return {"structured_output": canonical}


def plain_row_id(value: Any, *, columns: PlainColumns, fallback_id: str) -> str:
    """The id of the plain row ``value`` (``fallback_id`` where the file has no id column and
    the row none of its own), the first thing ``parse_plain_row`` reads: RowError (without a
    row id) when it has none it can keep; any error past it carries this id."""
    if not isinstance(value, dict):
        raise RowError(f"expected a JSON object per line, got {type_name(value)}")
    return _row_id(value, columns, fallback_id)


def _row_id(value: dict[str, Any], columns: PlainColumns, fallback_id: str) -> str:
    name = columns.id_column or columns.config_id_column
    raw = value.get(name) if name is not None else None
    if raw is None or raw == "" or (isinstance(raw, float) and math.isnan(raw)):
        if columns.id_column is None:
            return fallback_id
        fix = (
            _BATCH_HINT
            if _batch_line(value)
            else "give every row a unique id, or set input.id_column: null to use file:line ids"
        )
        raise RowError(
            f"missing id: column {columns.id_column!r} is absent, null or empty in this row; {fix}"
        )
    if isinstance(raw, str):
        return raw
    if isinstance(raw, int | uuid.UUID) and not isinstance(raw, bool):
        return str(raw)  # (a UUID key, as DuckDB and Spark write them: its canonical text)
    # pandas turns integer ids into floats when a column has nulls.
    if isinstance(raw, float) and raw.is_integer():
        return str(int(raw))
    raise RowError(
        f"id column {name!r} must hold a string, an integer or a UUID, got {type_name(raw)}; "
        "fix the id or set input.id_column"
    )


def _utf8(raw: bytes, name: str, row_id: str, what: str = "prompt") -> str:
    """A binary prompt (or messages) cell as text (what Spark's ``binaryAsString`` reads
    such a column as); RowError when its bytes are not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RowError(
            f"bad {what}: column {name!r} holds bytes that are not UTF-8 text ({exc.reason} "
            f"at byte {exc.start}); {'a prompt' if what == 'prompt' else what} must be text",
            row_id,
        ) from None


def _missing_prompt(value: dict[str, Any], columns: PlainColumns) -> str:
    name = columns.prompt_column
    if name in value:
        cell = value[name]
        empty = cell in (None, "", b"") or (isinstance(cell, float) and math.isnan(cell))
        what = "missing prompt" if empty else "bad prompt"
        return f"{what}: column {name!r} must be a non-empty string, got {type_name(cell)}"
    return _missing_column(value, columns, name)


def _missing_column(value: dict[str, Any], columns: PlainColumns, name: str) -> str:
    """The error of a row without the prompt or messages column ``name``: the columns it
    has, and what to set (an OpenAI Batch request line, that it is one)."""
    have = columns.columns_hint or ", ".join(list(value)[:20])
    message = f"missing prompt: no column {name!r} in this row (it has: {have or 'nothing'}); "
    if _batch_line(value):
        return message + _BATCH_HINT
    if name == columns.messages_column:
        return message + "set input.messages_column, or input.prompt_column for plain prompts"
    return message + "set input.prompt_column, or input.messages_column for chat rows"


_BATCH_HINT = "it is an OpenAI Batch request line: set input.format: openai-batch"


def _batch_line(value: dict[str, Any]) -> bool:
    """Whether a plain row is an OpenAI Batch request line (format detection looks at a
    file's first lines only)."""
    return {"custom_id", "body"} <= value.keys()
