"""Opening a GGUF file and reading its metadata, with errors that name the file.

    GGUF file:  magic "GGUF" | version | key/value metadata | tensor infos | aligned tensor data

``gguf.GGUFReader`` memory-maps the file; tensor data is only touched when dequantized.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # gguf is imported when a GGUF file is opened, not with the engine
    import gguf

__all__ = ["GGUF_MAGIC", "open_gguf", "metadata_value", "metadata_array_length"]

GGUF_MAGIC = b"GGUF"


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open and validate a GGUF file; a reader per (file, mtime, size) is cached.

    Raises FileNotFoundError if ``path`` is missing; ValueError naming the file if it is not a
    GGUF file, or is corrupt or truncated.
    """
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"GGUF file {path} does not exist") from None
    return _open_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


# Parsing a real model's metadata takes seconds (its token list is one field per token), and
# config, weights and tokenizer each need it: keep the last readers. The key includes mtime and
# size so a replaced file is re-read.
@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})"
        )
    import gguf  # a missing package must not read as a corrupt file below

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader fails with ValueError, IndexError, ... on damaged files
        raise ValueError(
            f"GGUF file {path} is corrupt or truncated ({type(e).__name__}: {e}); "
            "re-download or re-convert it"
        ) from e
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=reader.data_offset)
    if end > size:
        raise ValueError(
            f"GGUF file {path} is truncated: its tensors need {end} bytes, the file has {size}; "
            "re-download or re-convert it"
        )
    return reader


def metadata_value(reader: gguf.GGUFReader, key: str) -> Any:
    """The value of metadata ``key`` (str, int, float, bool or list), or None if absent.

    float32 values are returned as the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06), which is what the HF config they came from said.
    """
    field = reader.get_field(key)
    if field is None:
        return None
    value = field.contents()
    import gguf

    if field.types == [gguf.GGUFValueType.FLOAT32]:
        return float(str(np.float32(value)))
    return value


def metadata_array_length(reader: gguf.GGUFReader, key: str) -> int | None:
    """Number of elements of array ``key`` without decoding them, or None if absent."""
    field = reader.get_field(key)
    return None if field is None else len(field.data)
