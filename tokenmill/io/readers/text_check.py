"""Finding what a row carries that cannot be written out, before the row is run.

JSON may spell a string ``"\\ud800"``: Python's decoder accepts it and yields a str that is
not valid Unicode (a lone surrogate), which UTF-8, and so every output format, cannot encode.
Passthrough values are written as they are, so they must also encode as JSON (not nested past
Python's recursion limit). Such a row is refused when it is read, naming the field, instead of
failing the shard's commit (and every rerun's), and ``--dry-run`` finds it too.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.io.rows import InputRow

_MAX_DEPTH = 200  # prompts and messages are shallow; deeper parts are not walked


def unwritable_field(row: InputRow) -> str | None:
    """Why the first unwritable field of ``row`` is so (``"id holds text that is not valid
    Unicode ..."``, ``"passthrough column 'x' ..."``), or None when every field is fine."""
    fields: list[tuple[str, Any]] = [("id", row.row_id), ("custom_id", row.custom_id)]
    fields += [("prompt", row.prompt), ("messages", row.messages)]
    fields += [(f"sampling.{k}", v) for k, v in row.sampling.items()]
    for name, value in fields:
        where = _first_bad(value, name, 0)
        if where is not None:
            return f"{where} {_NOT_UNICODE}"
    for name, value in row.passthrough.items():
        problem = _json_problem(value)
        if problem is not None:
            return f"passthrough column {name!r} {problem}"
    return None


_NOT_UNICODE = "holds text that is not valid Unicode (a lone surrogate such as \\ud800)"


def _json_problem(value: Any) -> str | None:
    try:
        json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError:
        return _NOT_UNICODE
    except RecursionError:
        return "is nested too deeply to write"
    except (TypeError, ValueError) as exc:
        return f"cannot be written as JSON ({exc})"
    return None


def _first_bad(value: Any, where: str, depth: int) -> str | None:
    if isinstance(value, str):
        return None if writable_text(value) else where
    if depth > _MAX_DEPTH:
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not writable_text(key):
                return f"{where} (a key)"
            found = _first_bad(item, "", depth + 1)
            if found is not None:
                return f"{where}.{key}{found}" if isinstance(key, str) else where
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _first_bad(item, "", depth + 1)
            if found is not None:
                return f"{where}[{i}]{found}"
    return None


def writable_text(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (holds no lone surrogate)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
