"""GGUF Q4_0 / Q4_1 tensors as q4-rows weights (kernels/w4a16_gemm.py), without dequantizing.

A GGUF 4-bit tensor [N, K] is N rows of K / 32 blocks; a block holds its scale d (fp16), for
Q4_1 a min m (fp16), and 16 bytes of codes (byte i: input i in the low nibble, input i + 16
in the high one), so the bytes are already the q4-rows layout:

    Q4_1 block (20 bytes): [ d | m | qs0 .. qs15 ]   w = d * q + m
    Q4_0 block (18 bytes): [ d | qs0 .. qs15 ]       w = d * (q - 8)  ->  min = -8 * d

    -> qweight [N, K / 2] uint8, scales [N, K / 32] fp16, mins [N, K / 32] fp16
"""

from __future__ import annotations

import numpy as np

__all__ = ["NATIVE_Q4_TYPES", "q4_rows"]

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
NATIVE_Q4_TYPES = tuple(_BLOCK_BYTES)


def q4_rows(data: np.ndarray, type_name: str, rows: int) -> tuple[np.ndarray, ...]:
    """(qweight, scales, mins) of a GGUF ``type_name`` tensor of ``rows`` rows, its raw bytes
    ``data`` (any shape, rows * blocks * block bytes in all). Raises ValueError for another
    type or a size that is not whole blocks."""
    size = _BLOCK_BYTES.get(type_name)
    if size is None:
        raise ValueError(f"{type_name} has no 4-bit block layout here ({NATIVE_Q4_TYPES})")
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    if raw.size % (rows * size):
        raise ValueError(f"{raw.size} bytes are not {rows} rows of whole {type_name} blocks")
    blocks = raw.reshape(rows, -1, size)  # [N, K / 32, block]
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0]  # [N, K / 32]
    if type_name == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0]
        qs = blocks[:, :, 4:]
    else:
        m = (-8 * d.astype(np.float32)).astype(np.float16)
        qs = blocks[:, :, 2:]
    return np.ascontiguousarray(qs.reshape(rows, -1)), d, m
