"""Q8 rows to 16-bit weights on the GPU: the first half of a dequantize-then-GEMM W8A16.

The W8A16 GEMM (w8a16_gemm.py) dequantizes every weight once per M tile, and on the H200 it
is far slower than a bf16 GEMM at large M (BENCHMARKS.md, session 13); a 16-bit GEMM on
weights dequantized once per call reads them as a plain bf16 GEMM does. This kernel is that
dequantization. Its reference is ``dequantize_q8`` (w8a16_gemm.py), whose layout it reads:

    out[n, k] = scales[n, k // GROUP] * qweight[n, k]        (int8 codes, fp16 scales)

Kernel: grid (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)); each program loads a [BLOCK_N, BLOCK_K]
tile of codes (BLOCK_K a multiple or a divisor of GROUP, dividing K), multiplies each group
by its scale in fp32 (``scale_q8_tile``, as the W8A16 GEMM does) and writes the tile in the
output dtype (rounded once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.int_weight_tiles import fit_block_k
from tokenmill.kernels.w8a16_gemm import check_q8_weight, scale_q8_tile

__all__ = ["dequantize_q8_rows"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _dequantize_q8_kernel(
    qw_ptr, s_ptr, out_ptr,
    N,
    stride_qn, stride_sn, stride_on,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None]
    rows = offs_n[:, None].to(tl.int64)
    q = tl.load(qw_ptr + rows * stride_qn + offs_k[None, :], mask=mask, other=0)
    w = scale_q8_tile(q, s_ptr + rows * stride_sn, k0, mask, GROUP, BLOCK_N, BLOCK_K)
    out = out_ptr + rows * stride_on + offs_k[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_q8_rows(
    qweight: torch.Tensor,  # [N, K] int8, w8a16_gemm's q8-rows layout
    scales: torch.Tensor,  # [N, K / GROUP]
    dtype: torch.dtype = torch.bfloat16,
    *,
    block_n: int = 32,
    block_k: int = 256,
) -> torch.Tensor:
    """The [N, K] weights in ``dtype`` that (qweight, scales) stand for. Raises ValueError on
    a layout w8a16_gemm would refuse or an unsupported dtype."""
    if dtype not in _DTYPES:
        raise ValueError(f"dequantize_q8_rows: dtype must be one of {_DTYPES}, got {dtype}")
    n, k, group = check_q8_weight(qweight, scales, "dequantize_q8_rows")
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    if n == 0:
        return out
    block_k = fit_block_k(block_k, k, group)
    qw, s = qweight.contiguous(), scales.contiguous()
    grid = (triton.cdiv(n, block_n), k // block_k)
    _dequantize_q8_kernel[grid](
        qw, s, out, n,
        qw.stride(0), s.stride(0), out.stride(0),
        GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out
