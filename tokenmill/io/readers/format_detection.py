"""Deciding an input's format: by file suffix, then, for JSONL, by its first line."""

from __future__ import annotations

import json
import re
from typing import Any

from tokenmill.io.readers.compression import (
    DECOMPRESS_COMMANDS,
    compression_by_suffix,
    open_input,
    strip_compression_suffix,
)
from tokenmill.io.readers.file_listing import JSONL_SUFFIXES, PARQUET_SUFFIXES
from tokenmill.io.readers.input_config import FORMATS, InputConfig
from tokenmill.io.url_secrets import without_query

OPENAI_BATCH_KEYS = frozenset({"custom_id", "method", "url", "body"})


def detect_format(files: list[str], fmt: str, storage_options: dict[str, Any] | None = None) -> str:
    """The format of ``files``: ``fmt`` itself unless it is "auto".

    Auto: .jsonl/.json/.ndjson files, plain or compressed (x.jsonl.gz, .zst, .bz2, .xz), are
    "jsonl", or "openai-batch" when one of the first ``LOOK_AT_LINES`` non-blank lines of the
    files (decompressed) is an object with custom_id, method, url and body (the first alone
    decided: one bad first line made every good line of a batch file a bad plain row);
    .parquet files are "parquet".
    Raises ValueError naming a file when the suffixes are unknown or mixed, when a .json file
    holds one JSON array instead of JSON Lines, when a Parquet file has a compression
    suffix (x.parquet.gz; also with ``fmt`` "parquet"): Parquet compresses inside the file,
    when the first JSON Lines file is UTF-16 or UTF-32 text (every line a bad row), or
    (with ``fmt`` set) when a file's suffix names a compression or archive that is not
    read (x.jsonl.lz4, x.zip): its bytes would be read as rows.
    """
    if fmt not in FORMATS:
        raise ValueError(f"input.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "parquet":
        for f in files:
            _refuse_compressed_parquet(f)
    if fmt != "auto":
        for f in files:
            _refuse_unreadable_packing(f)
        if fmt != "parquet":
            _refuse_first_file(files, f"input.format {fmt} reads it", storage_options or {})
        return fmt
    if not files:
        raise ValueError("detect_format: no input files to look at")
    kinds = {f: format_by_name(f) for f in files}
    first = files[0]
    for f, kind in kinds.items():
        if kind != kinds[first]:
            raise ValueError(
                f"input mixes formats: {first} is {kinds[first]} but {f} is {kind}; "
                "point input.path at one kind of file"
            )
    if kinds[first] == "parquet":
        return "parquet"
    # The first line that says something: empty part files (routine in Spark / Hadoop
    # exports) say nothing.
    lines: list[str] = []
    for first in files[:LOOK_AT_FILES]:
        lines = _first_lines(first, storage_options or {}, LOOK_AT_LINES)
        if lines:
            break
    first_line = lines[0] if lines else ""
    _refuse_unreadable_start(first, first_line, "named as JSON Lines, it is read")
    # A JSON array, pretty-printed or on one line (not parsed: a one-line array of 2M rows
    # took 1.6 GB to end as one bad row, exit 0)
    if first_line.startswith("["):
        raise ValueError(
            f"{first} looks like one JSON array, not JSON Lines; write one JSON object per "
            "line (e.g. `jq -c '.[]' in.json > in.jsonl`)"
        )
    for line in lines:
        value = _json_or_none(line) if '"custom_id"' in line else None
        if isinstance(value, dict) and OPENAI_BATCH_KEYS <= value.keys():
            return "openai-batch"
    return "jsonl"


def input_format(cfg: InputConfig, files: list[str]) -> str:
    """The format of the input ``files`` of ``cfg``: the one found when they were listed
    (``InputConfig.files_format``), else ``detect_format``'s. A run's checks, fingerprint,
    schema and reader each detected it again: on an object store, a HEAD and a GET of the
    first file each time."""
    if cfg.files_format is not None and cfg.files is not None:
        return cfg.files_format
    return detect_format(files, cfg.format, cfg.storage_options)


def format_by_name(url: str) -> str:
    """The format ``url``'s name says, "jsonl" or "parquet" (an HTTP(S) URL's query string
    is not part of it: a presigned ``rows.jsonl?X-Amz-Signature=...`` is JSONL). Raises
    ValueError for a name that says neither, or a compressed Parquet file."""
    lower = strip_compression_suffix(without_query(url).lower())
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        _refuse_compressed_parquet(url)
        return "parquet"
    raise ValueError(
        f"cannot tell the format of {url} from its name (expected .jsonl, .json, .ndjson or "
        ".parquet, JSONL optionally compressed: .jsonl.gz .zst .bz2 .xz); rename it, set "
        "input.format (jsonl | parquet | openai-batch) to read every input file as that "
        "format, or point input.path at the data files alone (a glob: dir/**/*.jsonl)"
    )


# Compressions and archives that are not read: a file so named is refused, not read as text.
UNREADABLE_PACKING = (".lz4", ".snappy", ".sz", ".lzo", ".br", ".zip", ".tar", ".tgz", ".7z")


def _refuse_unreadable_packing(url: str) -> None:
    lower = without_query(url).lower()
    suffix = next((s for s in UNREADABLE_PACKING if lower.endswith(s)), None)
    if suffix is not None:
        raise ValueError(
            f"{url} is a {suffix} file, a compression or archive that is not read (the "
            "compressions read are .gz .zst .bz2 .xz); unpack it, or recompress it as one of those"
        )


def _refuse_compressed_parquet(url: str) -> None:
    codec = compression_by_suffix(url)
    if codec is not None:
        raise ValueError(
            f"{url} is a {codec}-compressed Parquet file; Parquet compresses inside the file "
            f"and is read only uncompressed: decompress it (`{DECOMPRESS_COMMANDS[codec]} "
            f"{url.rsplit('/', 1)[-1]}`) or rewrite it with "
            "pyarrow.parquet.write_table(..., compression='zstd')"
        )


# Files opened at most to find one that says something (a non-blank line, Parquet rows).
LOOK_AT_FILES = 64
# Lines of that file looked at for an OpenAI Batch request line.
LOOK_AT_LINES = 20


_PARQUET_MAGIC = b"PAR1"  # a Parquet file's first (and last) four bytes
_HEAD_BYTES = 1 << 16  # what an explicit format's check reads of the first file
_LINE_CAP = 16 << 20  # the longest first line read whole (a file with no \n is one line)
_LINES_READ = 1 << 16  # bytes read at a time looking for the first lines (most are shorter)
# One JSON value ends and another begins with only a carriage return between them: never
# valid JSON on one line (a raw CR cannot sit inside a string either), but a file whose
# lines end in CR alone (classic Mac OS, some spreadsheet exports) read as one line.
_CR_BETWEEN_RECORDS = re.compile(r"[}\]][ \t]*\r[ \t\r]*[{\[]")


def _refuse_first_file(files: list[str], why: str, storage_options: dict[str, Any]) -> None:
    """``_refuse_unreadable_start`` on the first line of the first input file that holds
    bytes (of the first ``LOOK_AT_FILES``; its first ``_HEAD_BYTES`` read)."""
    for url in files[:LOOK_AT_FILES]:
        with open_input(url, storage_options, peek=True) as f:
            head = f.read(_HEAD_BYTES)
        if head:
            first_line = head.split(b"\n", 1)[0].decode("utf-8-sig", errors="replace").strip()
            _refuse_unreadable_start(url, first_line, why)
            return


def _refuse_unreadable_start(url: str, first_line: str, why: str) -> None:
    """Raise ValueError when ``url``'s first line (as text) shows a file in which, read as
    JSON Lines (``why``: what makes it so), every row would be a bad row and the job
    "complete": a Parquet file, UTF-16 or UTF-32 text (JSON never holds a NUL byte; such
    text does among its first characters), or lines ending in a carriage return alone."""
    if first_line.startswith(_PARQUET_MAGIC.decode()):
        raise _parquet_as_json_lines(url, why)
    if "\x00" in first_line[:4]:
        raise _not_utf8_text(url)
    # a look for \r first: the search alone took 0.17 s over a 16 MiB line, the look 1 ms
    if "\r" in first_line and _CR_BETWEEN_RECORDS.search(first_line):
        raise _lines_end_in_cr(url)


def _parquet_as_json_lines(url: str, why: str) -> ValueError:
    return ValueError(
        f"{url} is a Parquet file (it begins with {_PARQUET_MAGIC.decode()}), but {why} as "
        "JSON Lines: every row would be a bad row. Set input.format to parquet (or name the "
        "file .parquet)"
    )


def _not_utf8_text(url: str) -> ValueError:
    """A JSON Lines file that starts with a NUL byte among its first characters: UTF-16 or
    UTF-32 text (what Windows PowerShell 5 writes by default), in which every line would be
    a bad row ("not valid UTF-8" / "not valid JSON") and the job "complete"."""
    return ValueError(
        f"{url} is not UTF-8 text: it holds NUL bytes where its first characters are, as "
        "UTF-16 or UTF-32 text does (what Windows PowerShell writes by default); every line "
        f"would be a bad row. Convert it to UTF-8 (`iconv -f UTF-16 -t UTF-8 "
        f"{url.rsplit('/', 1)[-1]}`; in PowerShell, `Out-File -Encoding utf8`)"
    )


def _lines_end_in_cr(url: str) -> ValueError:
    return ValueError(
        f"{url}'s lines end in a carriage return alone (\\r, as classic Mac OS and some "
        "spreadsheet exports write them), not \\n: the whole file would be read as one bad "
        f"row. Convert it (`tr '\\r' '\\n' < {url.rsplit('/', 1)[-1]} > rows.jsonl`)"
    )


def _first_lines(url: str, storage_options: dict[str, Any], count: int) -> list[str]:
    """The first ``count`` non-blank lines of ``url``, stripped; read ``_LINES_READ`` bytes
    at a time (fetched as they are read: ``open_input``'s peek), and
    a line longer than ``_LINE_CAP`` bytes is its beginning (a file with no \\n, or lines
    ending in \\r alone, is one line: not read whole)."""
    lines: list[str] = []
    # The line being read: only each new block is searched for \n (splitting the whole line
    # again at every block was quadratic: 1.7-3.0 s for a 20 MB first line, now 0.06 s).
    rest = bytearray()
    with open_input(url, storage_options, peek=True) as f:
        while len(lines) < count:
            chunk = f.read(_LINES_READ)
            *complete, tail = chunk.split(b"\n")
            if complete:
                complete[0] = bytes(rest) + complete[0]
                rest = bytearray(tail)
            else:
                rest += tail
            if not chunk or len(rest) > _LINE_CAP:
                complete.append(bytes(rest))
            for raw in complete:
                text = raw.decode("utf-8-sig", errors="replace").strip()  # (a mark alone: blank)
                if text:
                    lines.append(text)
            if not chunk or len(rest) > _LINE_CAP:
                break
    return lines[:count]


def _json_or_none(text: str) -> Any:
    """``text`` as JSON, or None where it cannot be read: the reader makes such a line a bad
    row (jsonl_records), so it must not fail the detection either. Beside JSONDecodeError,
    json raises RecursionError for nesting past ~1000 levels and a plain ValueError for an
    integer of more than 4,300 digits (they failed the job: exit 75, as a storage error)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
