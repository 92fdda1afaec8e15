"""SiLU-and-mul quantized per row to e4m3, with each row's columns spread over programs.

silu_and_mul.py's FP8 kernel gives a program whole rows, because a row's scale needs the
amax of all its I outputs. At Llama-3-8B's I = 14,336 the one-tile path holds a row in 16
warps at 99 registers a thread (ptxas for sm_90): one program fits an SM, it loads, reduces
and stores in turn, and the H200 moved its bytes at ~1 TB/s (sessions 13-14: 0.63 ms of an
8B FP8 decode step at 256 rows, 18 ms of a 140 ms mixed step). Here two launches share the
work over a (row, column chunk) grid of small programs instead:

    1. amax:     each program computes y for CHUNK columns of one row (and stores y when
                 asked) and writes the chunk's amax           -> partial [T, C] fp32
    2. quantize: each program takes its row's C partials, the row's scale (written by chunk
                 0), computes its chunk of y again from x and stores it as e4m3

x is read twice (the second read of a row shortly after the first, often from L2); y is
recomputed by the same element-wise formula, so q and scale are bit for bit the one-pass
kernel's (and ``quantize_rows(y)``'s): a max does not depend on the order it is taken in.
On the H200 at I = 14,336 it beat the one tile at every T from 16 to 8,192 (by 1.2-1.5x;
bench/fp8_gemm.py's down line, session 16), so silu_and_mul_fp8 takes it for I > 4096.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8_tiles import round_in_fp32, row_scale, to_e4m3
from tokenmill.kernels.silu_times import cuda_exp, silu_times_at

__all__ = ["silu_and_mul_fp8_split"]


@triton.jit
def _chunk_amax_kernel(
    x_ptr, partial_ptr, y_ptr,
    inter, num_chunks, stride_xt, stride_yt,
    CHUNK: tl.constexpr,
    WRITE_Y: tl.constexpr,
    CUDA_EXP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < inter
    gate = x_ptr + row * stride_xt
    y = silu_times_at(gate, offs, mask, inter, x_ptr.dtype.element_ty, CUDA_EXP)
    if WRITE_Y:
        tl.store(y_ptr + row * stride_yt + offs, y, mask=mask)
    tl.store(partial_ptr + row * num_chunks + chunk, tl.max(tl.abs(y.to(tl.float32)), axis=0))


@triton.jit
def _chunk_quantize_kernel(
    x_ptr, partial_ptr, q_ptr, scale_ptr,
    inter, num_chunks, stride_xt, stride_qt,
    CHUNK: tl.constexpr,
    CHUNKS_P2: tl.constexpr,  # next power of two >= num_chunks
    CUDA_EXP: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    parts = tl.arange(0, CHUNKS_P2)
    amax = tl.max(tl.load(partial_ptr + row * num_chunks + parts, mask=parts < num_chunks,
                          other=0.0), axis=0)  # fmt: skip
    scale = row_scale(amax)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < inter
    gate = x_ptr + row * stride_xt
    yf = silu_times_at(gate, offs, mask, inter, x_ptr.dtype.element_ty, CUDA_EXP).to(tl.float32)
    tl.store(q_ptr + row * stride_qt + offs, to_e4m3(yf, scale, ROUND_IN_FP32), mask=mask)


def silu_and_mul_fp8_split(
    x: torch.Tensor,  # [T, 2I], checked by the caller
    q: torch.Tensor,  # [T, I] e4m3, contiguous
    scale: torch.Tensor,  # [T, 1] fp32
    out: torch.Tensor | None,  # [T, I] in x's dtype: y too, when given
    chunk: int,  # columns a program, a power of two
) -> None:
    """Fill ``q`` and ``scale`` (and ``out``) for x, T >= 1 and I >= 1: see the module
    docstring. No host syncs (CUDA-graph capturable)."""
    t, inter = x.shape[0], x.shape[1] // 2
    chunk = min(chunk, triton.next_power_of_2(inter))
    num_chunks = triton.cdiv(inter, chunk)
    partial = torch.empty(t, num_chunks, dtype=torch.float32, device=x.device)
    num_warps = max(1, min(8, chunk // 256))  # 8 outputs (16 inputs) a thread
    y = out if out is not None else q  # never touched when WRITE_Y is False
    _chunk_amax_kernel[(t, num_chunks)](
        x, partial, y, inter, num_chunks, x.stride(0), y.stride(0),
        CHUNK=chunk, WRITE_Y=out is not None, CUDA_EXP=cuda_exp(), num_warps=num_warps,
    )  # fmt: skip
    _chunk_quantize_kernel[(t, num_chunks)](
        x, partial, q, scale, inter, num_chunks, x.stride(0), q.stride(0),
        CHUNK=chunk, CHUNKS_P2=triton.next_power_of_2(num_chunks), CUDA_EXP=cuda_exp(),
        ROUND_IN_FP32=round_in_fp32(), num_warps=num_warps,
    )  # fmt: skip
