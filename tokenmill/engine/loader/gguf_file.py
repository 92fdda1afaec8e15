"""Opening a GGUF file and reading its metadata, with errors that name the file.

    GGUF file:  magic "GGUF" | version | key/value metadata | tensor infos | aligned tensor data

gguf_reader.py reads the metadata and the tensor table and memory-maps the file; tensor data
is only touched when dequantized.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # gguf is imported when a GGUF file is opened, not with the engine
    from tokenmill.engine.loader.gguf_reader import GGUFFile

__all__ = ["GGUF_MAGIC", "open_gguf", "metadata_value", "metadata_array_length"]

GGUF_MAGIC = b"GGUF"


def open_gguf(path: Path) -> GGUFFile:
    """Open and validate a GGUF file; a reader per (file, mtime, size) is cached.

    Raises FileNotFoundError if ``path`` is missing; ValueError naming the file if it is not a
    GGUF file, or is corrupt or truncated.
    """
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"GGUF file {path} does not exist") from None
    return _open_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


# Config, weights and the chat template each need the metadata: keep the last files read.
# The key includes mtime and size so a replaced file is re-read.
@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})"
        )
    # gguf (its type tables) is needed here; a missing package must not read as a corrupt file
    from tokenmill.engine.loader.gguf_reader import read_gguf

    try:
        return read_gguf(Path(path))
    except (ValueError, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise ValueError(
            f"GGUF file {path} is corrupt or truncated ({type(e).__name__}: {e}); "
            "re-download or re-convert it"
        ) from e


def metadata_value(reader: GGUFFile, key: str) -> Any:
    """The value of metadata ``key`` (str, int, float, bool or list), or None if absent.

    float32 values are returned as the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06), which is what the HF config they came from said.
    """
    field = reader.get_field(key)
    if field is None:
        return None
    value = field.contents()
    from gguf import GGUFValueType

    if field.types == [GGUFValueType.FLOAT32]:
        return float(str(np.float32(value)))
    return value


def metadata_array_length(reader: GGUFFile, key: str) -> int | None:
    """Number of elements of array ``key``, or None if absent."""
    field = reader.get_field(key)
    return None if field is None else len(field)
