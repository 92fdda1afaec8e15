"""A GGUF file's metadata and tensor table, read in one pass over its header bytes; the
tensor data stays in a read-only memory map.

    header:  "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata (count times):  key (u64 length + utf-8) | value type u32 | value
        value: a scalar, a string (u64 length + utf-8), or an array: item type u32 |
               count u64 | items
    tensor infos (count times):  name | n_dims u32 | dims u64 x n_dims (fastest first) |
                                 type u32 | offset u64 (from the data start)
    data: at the first multiple of general.alignment (default 32) after the infos

The gguf package's reader makes a numpy view per value, so a real model's tokenizer arrays
(one string per token and per merge) take seconds to read (3.0 s for SmolLM2's 98k strings
here); this reads numeric arrays with one ``np.frombuffer`` and strings from the bytes
(0.1 s), the same values. Tensors come as the gguf package presents them, so its
``quants.dequantize`` takes their data: ``shape`` in GGUF order, ``data`` in torch order,
float types as their numpy dtype, block types as bytes [..., bytes per row].
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

__all__ = ["GGUFField", "GGUFFile", "GGUFTensor", "read_gguf"]

_SCALARS = {  # value type -> struct format
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
_NUMPY = {  # value type -> numpy dtype of an array of them
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16, GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64, GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}  # fmt: skip
_TENSOR_DTYPES = {  # tensor types held as numpy values; every other type is bytes
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


@dataclass(frozen=True)
class GGUFField:
    """One metadata entry: ``types`` is [type] for a scalar or string, [ARRAY, item type]
    for an array; ``value`` a Python value, a list for an array of strings or arrays, and a
    read-only numpy view of the file for an array of numbers (a list of a 64 MiB array took
    ten times that in memory); ``contents()`` gives every array as a list."""

    name: str
    types: list[GGUFValueType]
    value: Any

    def contents(self) -> Any:
        return _listed(self.value)

    def __len__(self) -> int:
        """An array's item count (1 for a scalar or a string)."""
        return len(self.value) if self.types[0] == GGUFValueType.ARRAY else 1


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dim first
    data: np.ndarray  # torch order; bytes [..., bytes per row] for block types
    data_offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, GGUFField]
    tensors: list[GGUFTensor]
    data_offset: int

    def get_field(self, key: str) -> GGUFField | None:
        return self.fields.get(key)


_MAX_NESTING = 8  # arrays of arrays: real files hold arrays of numbers and strings only
# Strings and arrays held in arrays, over the whole header, each a Python object: a real
# file's vocabulary and merges are well under a million; a file of 5 million empty arrays
# (60 MB) took 22 s and 730 MB to read.
_MAX_ITEMS = 4_000_000
_INTEGERS = (
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
)  # fmt: skip


class _Bytes:
    """A cursor over the header bytes; running past their end raises ValueError."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0
        self.items = 0  # strings and arrays read in arrays so far (_MAX_ITEMS)

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"the file ends inside its header (at byte {self.pos}, {n} more)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def value(self, vtype: GGUFValueType, depth: int = 0) -> tuple[Any, list[GGUFValueType]]:
        if vtype == GGUFValueType.STRING:
            return self.string(), [vtype]
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype]), [vtype]
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {int(vtype)}")
        if depth >= _MAX_NESTING:
            raise ValueError(f"metadata arrays nested over {_MAX_NESTING} deep")
        item = GGUFValueType(self.unpack("<I"))
        count = self.unpack("<Q")
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
            raw = self.take(count * dtype.itemsize)
            return np.frombuffer(raw, dtype=dtype), [vtype, item]
        self.items += count
        if self.items > _MAX_ITEMS:
            raise ValueError(
                f"its metadata holds over {_MAX_ITEMS:,} strings and arrays in arrays (a "
                "model's vocabulary and merges are well under a million)"
            )
        items = [_listed(self.value(item, depth + 1)[0]) for _ in range(count)]
        return items, [vtype, item]


def _listed(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def read_gguf(path: Path) -> GGUFFile:
    """Read ``path``'s metadata and tensor table. Raises ValueError (not naming the file: the
    caller does) for a file that is not GGUF, ends early, or holds unknown types."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Bytes(memoryview(data))
    if bytes(cur.take(4)) != b"GGUF":
        raise ValueError("it does not start with GGUF")
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_fields = cur.unpack("<Q"), cur.unpack("<Q")
    fields = {}
    for _ in range(n_fields):
        name = cur.string()
        value, types = cur.value(GGUFValueType(cur.unpack("<I")))
        if name in fields:  # which one holds is anyone's guess (llama.cpp refuses it too)
            raise ValueError(f"metadata key {name} is given twice")
        fields[name] = GGUFField(name, types, value)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        infos.append((name, dims, GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q")))
    align_field = fields.get("general.alignment")
    align = 32
    if align_field is not None:
        if align_field.types[0] not in _INTEGERS:
            raise ValueError("general.alignment must be an integer")
        align = align_field.value
    if align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment is {align}; it must be a power of two")
    start = -(-cur.pos // align) * align
    tensors = [_tensor(data, start, *info) for info in infos]
    _check_table(tensors, align, start)
    return GGUFFile(fields, tensors, start)


def _check_table(tensors: list[GGUFTensor], align: int, start: int) -> None:
    """Refuse a tensor table a bit flip or a faulty writer left inconsistent: a name given
    twice (the last copy won), data at an offset off the alignment, or two tensors whose data
    overlap (one read the other's bytes). Each loaded, unnoticed, as wrong weights."""
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise ValueError(f"tensor {t.name} is listed twice in the tensor table")
        seen.add(t.name)
        if (t.data_offset - start) % align:
            raise ValueError(
                f"tensor {t.name}'s data offset {t.data_offset - start} is not a multiple of "
                f"the alignment ({align})"
            )
    spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in tensors)
    for (_, end, name), (begin, _, other) in itertools.pairwise(spans):
        if begin < end:
            raise ValueError(f"tensors {name} and {other} have overlapping data")


def _tensor(
    data: np.ndarray, start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType,
    offset: int,
) -> GGUFTensor:  # fmt: skip
    block, type_bytes = GGML_QUANT_SIZES[kind]
    if not dims:
        raise ValueError(f"tensor {name} has no dimensions")
    if dims[0] % block:  # (it read as a corrupt file: "cannot reshape array of size ...")
        raise ValueError(
            f"tensor {name} ({kind.name}) has rows of {dims[0]} values, not whole blocks of "
            f"{block}: no GGUF writer makes that"
        )
    count = int(np.prod(dims))
    n_bytes = count * type_bytes // block
    begin = start + offset
    if begin + n_bytes > data.size:
        raise ValueError(
            f"tensor {name} needs bytes {begin}..{begin + n_bytes}, the file has {data.size}"
        )
    raw = data[begin : begin + n_bytes]
    torch_order = tuple(reversed(dims))
    if kind in _TENSOR_DTYPES:
        array = raw.view(_TENSOR_DTYPES[kind]).reshape(torch_order)
    else:
        array = raw.reshape(*torch_order[:-1], dims[0] * type_bytes // block)
    return GGUFTensor(name, kind, dims, array, begin, n_bytes)
