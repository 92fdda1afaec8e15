"""Deciding an input's format: by file suffix, then, for JSONL, by its first line."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.io.readers.file_listing import JSONL_SUFFIXES, PARQUET_SUFFIXES
from tokenmill.io.readers.input_config import FORMATS
from tokenmill.io.readers.storage import resolve

OPENAI_BATCH_KEYS = frozenset({"custom_id", "method", "url", "body"})


def detect_format(files: list[str], fmt: str, storage_options: dict[str, Any] | None = None) -> str:
    """The format of ``files``: ``fmt`` itself unless it is "auto".

    Auto: .jsonl/.json/.ndjson files are "jsonl", or "openai-batch" when the first non-blank
    line of the first file is an object with custom_id, method, url and body; .parquet files
    are "parquet". Raises ValueError naming a file when the suffixes are unknown or mixed, or
    when a .json file holds one JSON array instead of JSON Lines.
    """
    if fmt not in FORMATS:
        raise ValueError(f"input.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    if not files:
        raise ValueError("detect_format: no input files to look at")
    kinds = {f: _kind_by_suffix(f) for f in files}
    first = files[0]
    for f, kind in kinds.items():
        if kind != kinds[first]:
            raise ValueError(
                f"input mixes formats: {first} is {kinds[first]} but {f} is {kind}; "
                "point input.path at one kind of file"
            )
    if kinds[first] == "parquet":
        return "parquet"
    first_line = _first_line(first, storage_options or {})
    if first_line.startswith("[") and _json_or_none(first_line) is None:
        raise ValueError(
            f"{first} looks like one JSON array, not JSON Lines; write one JSON object per "
            "line (e.g. `jq -c '.[]' in.json > in.jsonl`)"
        )
    value = _json_or_none(first_line)
    if isinstance(value, dict) and OPENAI_BATCH_KEYS <= value.keys():
        return "openai-batch"
    return "jsonl"


def _kind_by_suffix(url: str) -> str:
    lower = url.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise ValueError(
        f"cannot tell the format of {url} from its name (expected .jsonl, .json, .ndjson or "
        ".parquet); rename it or set input.format (jsonl | parquet | openai-batch)"
    )


def _first_line(url: str, storage_options: dict[str, Any]) -> str:
    fs, path = resolve(url, storage_options)
    with fs.open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                return raw.decode("utf-8-sig", errors="replace").strip()
    return ""


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
