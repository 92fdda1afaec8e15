"""Checks a job's spec against its output and input before any weight is loaded: exit 2,
key named.

    output.path allowed? ─► input.path lists files? ─► their format ─► output.format fits?
                                                                    ─► Parquet: prompt or
                                                                       messages column there?

A spec that cannot work fails here, in seconds, instead of after minutes of inference or
with every row in the error file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import pyarrow as pa

from tokenmill.io.logprobs_column import LOGPROBS
from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.prompt_logprobs_column import PROMPT_LOGPROBS
from tokenmill.io.readers import InputConfig, detect_format, list_input_files, passthrough_schema
from tokenmill.io.readers.file_listing import warn_hidden_matches
from tokenmill.io.readers.format_detection import LOOK_AT_FILES
from tokenmill.io.readers.input_config import DEFAULT_ID_COLUMN
from tokenmill.io.readers.jsonl_records import JsonlRecords
from tokenmill.io.readers.parquet_footers import ParquetFooter, ParquetFooters
from tokenmill.io.readers.parquet_records import ParquetRecords
from tokenmill.io.storage import StorageError
from tokenmill.io.url_secrets import url_credentials_refusal
from tokenmill.jobs.error_chain import in_chain
from tokenmill.jobs.output_location import check_output_location, check_output_outside_model
from tokenmill.jobs.spec import JobSpec, JobSpecError
from tokenmill.jobs.stop_signals import JobInterrupted

log = logging.getLogger("tokenmill.jobs")


def input_config(spec: JobSpec) -> InputConfig:
    i = spec.input
    return InputConfig(
        path=i.path,
        format=i.format,
        id_column=i.id_column,
        prompt_column=i.prompt_column,
        messages_column=i.messages_column,
        passthrough_columns=tuple(i.passthrough_columns),
        storage_options=dict(i.storage_options),
        structured_output_column=i.structured_output_column,
    )


def check_up_front(spec: JobSpec) -> InputConfig:
    """Everything a run checks before taking the lock or loading weights: where it may write
    (``check_output_location``, ``check_output_outside_model``) and what it reads
    (``check_input``). Returns the input config with its files as listed for the checks
    (``InputConfig.files``); raises JobSpecError naming the key."""
    for key, url in (("input.path", spec.input.path), ("output.path", spec.output.path)):
        refusal = url_credentials_refusal(key, url)
        if refusal is not None:
            raise JobSpecError(refusal)
    check_output_location(
        spec.output.path,
        dict(spec.output.storage_options),
        spec.input.path,
        dict(spec.input.storage_options),
    )
    check_output_outside_model(spec.output.path, spec.model.source)
    return check_input(spec)


def store_failure(what: str, exc: Exception, options: str) -> Exception:
    """The error to raise for ``what`` (``output.path 's3://…'``) when its store's client
    failed with ``exc`` at the start: a JobSpecError (exit 2) for what stays until someone
    fixes it (refused credentials, a missing bucket, a malformed option), a StorageError
    (exit 75: retry later) for the store being out of reach (connection refused, timeouts),
    which a rerun once it is back gets past. Both name ``what``."""
    text = f"{what} cannot be reached ({type(exc).__name__}: {exc}); check the address, {options}"
    lasting = (PermissionError, FileNotFoundError, NotADirectoryError, ValueError, TypeError)
    if in_chain(exc, lambda e: isinstance(e, lasting) or _refused(e)) is not None:
        return JobSpecError(text)
    return StorageError(f"{text} and the network; rerun once the store is reachable")


def _refused(exc: BaseException) -> bool:
    """An HTTP client's error for a request the server refused or has nothing for (aiohttp's
    ClientResponseError carries ``status``): a password or an address to fix, not an outage."""
    return getattr(exc, "status", None) in (401, 403, 404)


def check_input(spec: JobSpec) -> InputConfig:
    """The job's input config with its files listed once (``InputConfig.files``: a run's
    fingerprint, row count, schema and reads all take that listing; a folder filling
    meanwhile made a run read files its fingerprint did not hold, and every rerun then
    refused as "the input changed"), after checking that the spec can read the input and
    write its output. Raises JobSpecError naming the key (input.path, output.format,
    input.prompt_column, ...)."""
    try:
        cfg = input_config(spec)
    except ValueError as exc:
        raise JobSpecError(str(exc)) from None
    try:
        files = list_input_files(cfg)
        warn_hidden_matches(cfg, files)
        fmt = detect_format(files, cfg.format, cfg.storage_options)
    except (FileNotFoundError, ValueError) as exc:
        raise input_error(exc) from None
    except JobInterrupted:
        raise
    except Exception as exc:  # the store's client: refused credentials, unreachable endpoint
        raise store_failure(
            f"input.path {cfg.path!r}", exc, "input.storage_options (endpoint_url, credentials)"
        ) from None
    if spec.output.format == "openai-batch" and fmt != "openai-batch":
        raise JobSpecError(
            f"output.format: openai-batch needs OpenAI Batch input lines (custom_id, method, "
            f"url, body), but input {cfg.path!r} is {fmt}; set output.format to jsonl or "
            "parquet"
        )
    if cfg.structured_output_column is not None and fmt == "openai-batch":
        raise JobSpecError(
            "input.structured_output_column: OpenAI Batch input gives each row's constraint in "
            "its body's response_format; remove input.structured_output_column"
        )
    if spec.output.format == "openai-batch" and cfg.passthrough_columns:
        raise JobSpecError(  # they were dropped without a word
            "input.passthrough_columns: OpenAI Batch output lines hold the custom_id, the "
            "response and the error only, so these columns would not be written; leave them "
            "out, or set output.format to jsonl or parquet to keep them beside the results"
        )
    for column, setting in (
        (PROMPT_LOGPROBS, spec.sampling.prompt_logprobs),
        (LOGPROBS, spec.sampling.logprobs),
    ):
        clash = [c for c in cfg.passthrough_columns if c.lower() == column]  # as duckdb reads
        # The column is written when the job asks, or (OpenAI Batch input) any body may.
        if clash and (setting is not None or fmt == "openai-batch"):
            why = f"sampling.{column} is set" if setting is not None else "a body may ask for it"
            raise JobSpecError(
                f"input.passthrough_columns: {clash[0]!r} would overwrite the output column "
                f"{column!r} ({why}; names are compared without case, as duckdb and Spark "
                "read them); rename it in the input or leave it out"
            )
    footers = ParquetFooters() if fmt == "parquet" else None
    if footers is not None:
        # (Parquet output warns of absent passthrough columns over every file: output_schema)
        look = _first_with_rows(files, cfg, footers)
        _check_parquet_columns(look, cfg, spec.output.format != "parquet")
    elif fmt == "jsonl":
        _check_jsonl_columns(files, cfg)
    return replace(cfg, files=tuple(files), files_format=fmt, footers=footers)


_ABSENT_PASSTHROUGH = (
    "input.passthrough_columns %s: not a %s of %s, so null in their output rows (a "
    "misspelling? hive-style folder keys such as date=... are not read as columns)"
)


def _check_jsonl_columns(files: list[str], cfg: InputConfig) -> None:
    """Configured column names against the first objects of the first file that has any
    (JSONL has no schema; a Spark part file may be empty): a prompt or messages column in
    none of them is refused, as Parquet's is (every row would be a bad row, and the job
    "complete"), and so is a structured-output or id column (every row would run
    unconstrained, or get file:line ids, silently); passthrough columns are warned about."""
    for url in files[:LOOK_AT_FILES]:  # as format detection, a bounded look
        with JsonlRecords(url, cfg.storage_options, peek=True) as records:
            keys, objects = records.keys_seen()
        if objects:
            break
    else:
        return
    where = f"any of the first {objects} rows of {url}"
    have = ", ".join(sorted(keys)[:20]) or "no keys"
    named_id = cfg.id_column if cfg.id_column != DEFAULT_ID_COLUMN else None
    prompt_key = "messages_column" if cfg.messages_column is not None else "prompt_column"
    fixes = {
        "id_column": "leave it out for file:line ids",
        "prompt_column": "set input.prompt_column, or input.messages_column for chat rows",
        "messages_column": "set input.messages_column, or input.prompt_column for plain prompts",
    }
    for key, name in ((prompt_key, getattr(cfg, prompt_key)),
                      ("structured_output_column", cfg.structured_output_column),
                      ("id_column", named_id)):  # fmt: skip
        if name is not None and name not in keys:
            raise JobSpecError(
                f"input.{key}: {name!r} is not a key of {where} (they have: {have}); "
                + fixes.get(key, "fix the name")
            )
    absent = [n for n in cfg.passthrough_columns if n not in keys]
    if absent:
        log.warning(_ABSENT_PASSTHROUGH, ", ".join(repr(n) for n in absent), "key", where)


@dataclass(frozen=True)
class _ParquetLook:
    """What a look at one Parquet file's footer found: its columns, their types, its rows."""

    url: str
    columns: tuple[str, ...]
    types: dict[str, pa.DataType]
    num_rows: int


def _look_at(url: str, cfg: InputConfig, footers: ParquetFooters) -> _ParquetLook:
    """``url``'s footer, kept in ``footers`` for the run's later readers of it."""
    with ParquetRecords(url, cfg.storage_options, []) as records:
        look = _ParquetLook(url, records.columns(), records.column_types(), records.num_rows)
    footers.keep(url, ParquetFooter.of_types(look.num_rows, look.types, cfg.passthrough_columns))
    return look


def _first_with_rows(files: list[str], cfg: InputConfig, footers: ParquetFooters) -> _ParquetLook:
    """The footer of the first Parquet file holding rows (an empty part file says nothing of
    the columns the rows have); the first file's when none does. Each file is opened once
    (its footer read again for the column check was a second HEAD and GET of it)."""
    first: _ParquetLook | None = None
    for url in files[:LOOK_AT_FILES]:  # as format detection, a bounded look
        look = _look_at(url, cfg, footers)
        if look.num_rows:
            return look
        first = first or look
    return first or _look_at(files[0], cfg, footers)  # (files: never empty, as listed)


def _check_parquet_columns(look: _ParquetLook, cfg: InputConfig, passthrough: bool) -> None:
    """Configured column names against the columns ``look`` found in its file: a prompt, id
    or structured-output column it lacks is refused; with ``passthrough``, passthrough
    columns it lacks are warned about."""
    key, column = (
        ("messages_column", cfg.messages_column)
        if cfg.messages_column is not None
        else ("prompt_column", cfg.prompt_column)
    )
    constraint = cfg.structured_output_column
    url, have = look.url, ", ".join(look.columns)
    has_prompt = column is None or column in look.columns
    prompt_type = look.types.get(column) if column is not None else None
    has_constraint = constraint is None or constraint in look.columns
    has_id = cfg.id_column in (None, DEFAULT_ID_COLUMN) or cfg.id_column in look.columns
    absent = [n for n in cfg.passthrough_columns if n not in look.columns]
    if passthrough and absent:
        log.warning(_ABSENT_PASSTHROUGH, ", ".join(repr(n) for n in absent), "column", url)
    if not has_constraint:  # a misspelt name would leave every row unconstrained, silently
        raise JobSpecError(
            f"input.structured_output_column: {constraint!r} is not a column of {url} "
            f"(it has: {have or 'no columns'})"
        )
    if not has_id:  # every row would get a file:row id, silently
        raise JobSpecError(
            f"input.id_column: {cfg.id_column!r} is not a column of {url} (it has: "
            f"{have or 'no columns'}); leave it out for file:row ids"
        )
    if not has_prompt:
        raise JobSpecError(
            f"input.{key}: {column!r} is not a column of {url} (it has: {have or 'no columns'}); "
            "set input.prompt_column, or input.messages_column for chat rows"
        )
    if prompt_type is not None and not _can_hold(key, prompt_type):
        what = "text" if key == "prompt_column" else "a list of messages or their JSON text"
        raise JobSpecError(  # every row of the file would be a bad row, and the job "complete"
            f"input.{key}: column {column!r} of {url} is of type {prompt_type}, which cannot "
            f"hold {what}; name the column that holds them, or cast this one to string"
        )


def _can_hold(key: str, dtype: pa.DataType) -> bool:
    """Whether a Parquet column of ``dtype`` can hold a row's prompt (``key``
    "prompt_column": text, or bytes read as UTF-8 text) or conversation ("messages_column":
    a list of messages, or JSON text). An all-null column (type null) can: its rows are each
    a "missing prompt", as a JSONL file's null prompts are."""
    if pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    text = (
        pa.types.is_string(dtype)
        or pa.types.is_large_string(dtype)
        or pa.types.is_string_view(dtype)
        or pa.types.is_null(dtype)
    )
    if key == "messages_column":
        lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
        lists += (pa.types.is_list_view, pa.types.is_large_list_view)
        return text or any(is_list(dtype) for is_list in lists)
    binary = (
        pa.types.is_binary(dtype)
        or pa.types.is_large_binary(dtype)
        or pa.types.is_binary_view(dtype)
        or pa.types.is_fixed_size_binary(dtype)
    )
    return text or binary


def output_schema(spec: JobSpec, cfg: InputConfig) -> OutputSchema | None:
    """The Parquet schema every shard of ``spec`` is written with (None for JSONL and OpenAI
    Batch output): passthrough types from the input (``passthrough_schema``), decided before
    the first shard, and the prompt_logprobs / logprobs column when ``sampling.prompt_logprobs``
    / ``sampling.logprobs`` is set. Raises JobSpecError naming input.passthrough_columns when
    Parquet input files hold a passthrough column in types that do not combine, or one named
    as such a column of the job's."""
    if spec.output.format != "parquet":
        return None
    try:
        schema = passthrough_schema(cfg)
        if spec.sampling.prompt_logprobs is not None:
            schema = schema.with_prompt_logprobs()
        if spec.sampling.logprobs is not None:
            schema = schema.with_logprobs()
        return schema
    except (FileNotFoundError, ValueError) as exc:
        raise input_error(exc) from None


def input_error(exc: Exception) -> JobSpecError:
    """``exc`` about the input as the JobSpecError it is: named ``input.path`` unless its
    message names its key itself."""
    message = str(exc)
    return JobSpecError(message if message.startswith("input.") else f"input.path: {message}")
