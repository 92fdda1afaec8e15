"""Helpers for reader tests: write small JSONL / Parquet / OpenAI Batch files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.io.readers import InputConfig, iter_input_rows
from tokenmill.io.rows import InputRow


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """One line per entry: dicts/lists/numbers as JSON, strings written as they are (raw lines)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_parquet(path: Path, columns: dict[str, list[Any]], row_group_size: int = 64) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def batch_line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "any", "messages": [{"role": "user", "content": "hi"}], **fields}


def read(path: Path | str, **cfg: Any) -> list[InputRow]:
    return list(iter_input_rows(InputConfig(path=str(path), **cfg)))


def summary(rows: list[InputRow]) -> list[tuple[int, str, bool]]:
    """(row_index, row_id, ok) per row."""
    return [(r.row_index, r.row_id, r.error is None) for r in rows]
