"""GGUF Q4_0 / Q4_1 / Q8_0 tensors as the weights of the W4A16 and W8A16 kernels, without
dequantizing, and their float32 values (the dequantizing loader's fast path).

A GGUF block tensor [N, K] is N rows of K / 32 blocks; a block holds its scale d (fp16), for
Q4_1 a min m (fp16), and its codes. Q4 blocks hold 16 bytes of codes (byte i: input i in
the low nibble, input i + 16 in the high one), so the bytes are already the q4-rows layout
(kernels/w4a16_gemm.py); Q8_0 blocks hold 32 signed bytes, the q8-rows layout
(kernels/w8a16_gemm.py) once the scales are moved out:

    Q4_1 block (20 bytes): [ d | m | qs0 .. qs15 ]   w = d * q + m
    Q4_0 block (18 bytes): [ d | qs0 .. qs15 ]       w = d * (q - 8)  ->  min = -8 * d
        -> qweight [N, K / 2] uint8, scales [N, K / 32] fp16, mins [N, K / 32] fp16
    Q8_0 block (34 bytes): [ d | qs0 .. qs31 ]       w = d * q        (q signed)
        -> qweight [N, K] int8, scales [N, K / 32] fp16

``dequantize_blocks`` computes the float32 weights of any of the three in numpy, the same
operations in the same order as the gguf package's (d * q, then + m), so the values are
equal bit for bit, at a fraction of its time.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK_TYPES", "NATIVE_TYPES", "block_rows", "dequantize_blocks"]

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
BLOCK_TYPES = frozenset(_BLOCK_BYTES)  # the types this file reads
# quantization method -> the GGUF block types it runs as they are
NATIVE_TYPES = {"int4": ("Q4_0", "Q4_1"), "int8": ("Q8_0",)}


def _blocks(data: np.ndarray, type_name: str, rows: int) -> np.ndarray:
    """The raw bytes as [rows, blocks, block bytes]."""
    size = _BLOCK_BYTES.get(type_name)
    if size is None:
        raise ValueError(f"{type_name} has no block layout here ({', '.join(_BLOCK_BYTES)})")
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    if raw.size % (rows * size):
        raise ValueError(f"{raw.size} bytes are not {rows} rows of whole {type_name} blocks")
    return raw.reshape(rows, -1, size)


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, :, start : start + 2].copy().view(np.float16)[:, :, 0]  # [N, K / 32]


def block_rows(data: np.ndarray, type_name: str, rows: int) -> tuple[np.ndarray, ...]:
    """A GGUF ``type_name`` tensor of ``rows`` rows (its raw bytes ``data``, any shape) as
    the kernel's tensors: (qweight, scales, mins) for Q4_0 / Q4_1, (qweight, scales) for
    Q8_0. Raises ValueError for another type or a size that is not whole blocks."""
    blocks = _blocks(data, type_name, rows)
    d = _fp16(blocks, 0)
    if type_name == "Q8_0":
        return np.ascontiguousarray(blocks[:, :, 2:].reshape(rows, -1).view(np.int8)), d
    if type_name == "Q4_1":
        m, qs = _fp16(blocks, 2), blocks[:, :, 4:]
    else:
        m, qs = (-8 * d.astype(np.float32)).astype(np.float16), blocks[:, :, 2:]
    return np.ascontiguousarray(qs.reshape(rows, -1)), d, m


def dequantize_blocks(data: np.ndarray, type_name: str, rows: int) -> np.ndarray:
    """The float32 weights [rows, K] of a GGUF Q4_0 / Q4_1 / Q8_0 tensor."""
    blocks = _blocks(data, type_name, rows)
    d = _fp16(blocks, 0).astype(np.float32)[:, :, None]
    if type_name == "Q8_0":
        w = blocks[:, :, 2:].view(np.int8).astype(np.float32) * d
        return w.reshape(rows, -1)
    qs = blocks[:, :, 4:] if type_name == "Q4_1" else blocks[:, :, 2:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).astype(np.int8)  # input order
    if type_name == "Q4_1":
        w = q.astype(np.float32) * d + _fp16(blocks, 2).astype(np.float32)[:, :, None]
    else:
        w = (q - np.int8(8)).astype(np.float32) * d
    return w.reshape(rows, -1)
