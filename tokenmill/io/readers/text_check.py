"""Finding text a row carries that cannot be written out: lone UTF-16 surrogates.

JSON may spell a string ``"\\ud800"``: Python's decoder accepts it and yields a str that is
not valid Unicode, which UTF-8 (every output format) cannot encode. Such a row is refused when
it is read, naming the field, instead of failing the shard's commit on every rerun.
"""

from __future__ import annotations

from typing import Any

from tokenmill.io.rows import InputRow

_MAX_DEPTH = 200  # deeper parts are left to the writer, which turns failures into row errors


def unwritable_field(row: InputRow) -> str | None:
    """The name of the first field of ``row`` holding text that is not valid Unicode
    (e.g. ``"id"``, ``"messages[0].content"``, ``"passthrough 'note'"``), or None."""
    fields: list[tuple[str, Any]] = [("id", row.row_id), ("custom_id", row.custom_id)]
    fields += [("prompt", row.prompt), ("messages", row.messages)]
    fields += [(f"passthrough {k!r}", v) for k, v in row.passthrough.items()]
    fields += [(f"sampling.{k}", v) for k, v in row.sampling.items()]
    for name, value in fields:
        where = _first_bad(value, name, 0)
        if where is not None:
            return where
    return None


def _first_bad(value: Any, where: str, depth: int) -> str | None:
    if isinstance(value, str):
        return None if _encodes(value) else where
    if depth > _MAX_DEPTH:
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not _encodes(key):
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


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
