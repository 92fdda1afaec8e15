"""Q4 rows to 16-bit weights on the GPU: the first half of a dequantize-then-GEMM W4A16.

At large M the W4A16 GEMM (w4a16_gemm.py) dequantizes every weight once per M tile, while a
16-bit GEMM on weights dequantized once per call reads them as a plain bf16 GEMM does; this
kernel is that dequantization. Its reference is ``dequantize_q4`` (w4a16_gemm.py), whose
layout it reads:

    out[n, 32c + i]      = scales[n, g] * lo(qweight[n, 16c + i]) + mins[n, g]
    out[n, 32c + 16 + i] = scales[n, g] * hi(qweight[n, 16c + i]) + mins[n, g]
                                                       g = 32c // GROUP, i in 0..15

Kernel: grid (cdiv(N, BLOCK_N), cdiv(K / 32, CHUNKS)); each program loads [BLOCK_N, 16]
bytes per chunk for CHUNKS chunks, splits the nibbles and writes both 16-input halves in
the output dtype. Computed in fp32 (the multiply and add may fuse into one rounding, so a
value can be an fp32 ulp off the reference's two roundings), then rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.w4a16_gemm import CHUNK, check_q4_weight

__all__ = ["dequantize_q4_rows"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _dequantize_q4_kernel(
    qw_ptr, s_ptr, m_ptr, out_ptr,
    N, NUM_CHUNKS,
    stride_qn, stride_sn, stride_mn, stride_on,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    offs_h = tl.arange(0, 16)[None, :]
    for j in range(CHUNKS):
        c = tl.program_id(1) * CHUNKS + j
        in_k = (offs_h * 0 + c) < NUM_CHUNKS  # [1, 16]: the chunk exists (a vector mask)
        mask = mask_n[:, None] & in_k
        b = tl.load(qw_ptr + rows * stride_qn + c * 16 + offs_h, mask=mask, other=0)
        g = (c * 32) // GROUP
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + offs_n * stride_mn + g, mask=mask_n, other=0.0).to(tl.float32)
        lo = (b & 0xF).to(tl.float32) * s[:, None] + mn[:, None]
        hi = (b >> 4).to(tl.float32) * s[:, None] + mn[:, None]
        out = out_ptr + rows * stride_on + c * 32 + offs_h
        tl.store(out, lo.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + 16, hi.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_q4_rows(
    qweight: torch.Tensor,  # [N, K / 2] uint8, w4a16_gemm's q4-rows layout
    scales: torch.Tensor,  # [N, K / GROUP]
    mins: torch.Tensor,  # [N, K / GROUP]
    dtype: torch.dtype = torch.bfloat16,
    *,
    block_n: int = 32,
    chunks: int = 8,
) -> torch.Tensor:
    """The [N, K] weights in ``dtype`` that (qweight, scales, mins) stand for. Raises
    ValueError on a layout w4a16_gemm would refuse or an unsupported dtype."""
    if dtype not in _DTYPES:
        raise ValueError(f"dequantize_q4_rows: dtype must be one of {_DTYPES}, got {dtype}")
    n, k, group = check_q4_weight(qweight, scales, mins, "dequantize_q4_rows")
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    if n == 0:
        return out
    qw, s, mn = qweight.contiguous(), scales.contiguous(), mins.contiguous()
    num_chunks = k // CHUNK
    grid = (triton.cdiv(n, block_n), triton.cdiv(num_chunks, chunks))
    _dequantize_q4_kernel[grid](
        qw, s, mn, out, n, num_chunks,
        qw.stride(0), s.stride(0), mn.stride(0), out.stride(0),
        GROUP=group, BLOCK_N=block_n, CHUNKS=chunks,
        # A step's tile is [block_n, 16] bytes: 1 warp moves it 16 bytes a lane (4 warps
        # loaded 4 and stored 8 bytes a lane in the sm_90 code, session 14)
        num_warps=max(1, block_n // 32),
    )  # fmt: skip
    return out
