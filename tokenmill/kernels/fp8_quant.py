"""Per-row FP8 quantization of activations: e4m3 values and one fp32 scale a row, in one
read of the input. The torch reference is ``quantize_rows`` (fp8_rows.py), which
the FP8 layer runs on CPU; this kernel replaces its ~8 kernels and fp32 intermediates on CUDA.

    x      [T, K]  bf16 / fp16 / fp32, any strides
    scale  [T, 1]  fp32      scale[t] = max(max_k |x[t, k]| / 448, 1e-12)
    q      [T, K]  e4m3fn    q[t, k]  = e4m3(clamp(x[t, k] / scale[t], -448, 448))

Both divisions are IEEE (``tl.div_rn``) and the cast rounds to nearest even, like torch, so
q and scale equal the reference's bit for bit (up to the sign of a zero); the tile arithmetic
is fp8_tiles.py's, shared with the kernels that write FP8 rows of their own output.

Kernel: grid (cdiv(T, ROWS),); each program quantizes ROWS whole rows.

    K <= 16384  one tile [ROWS, BLOCK_K], BLOCK_K = next_power_of_2(K): the rows are loaded
                once, their amax taken in registers, then scaled and stored (one pass)
    K >  16384  (or an explicit ``block_k``) two loops over K in chunks of BLOCK_K: the amax,
                then the store, whose reads of the same rows mostly hit L2

    row t:  [ chunk 0 | chunk 1 | ... | chunk n-1 (masked past K) ]
              pass 1: amax over all chunks  ->  scale[t]
              pass 2: q[t, chunk] = e4m3(x[t, chunk] / scale[t])

Small K packs several rows per program so each moves about 4096 elements. No host syncs:
the wrapper only allocates and launches (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8_rows import quantize_rows
from tokenmill.kernels.fp8_tiles import round_in_fp32, row_scale, to_e4m3

__all__ = ["quantize_rows_fp8", "quantize_rows_fp8_ref"]

quantize_rows_fp8_ref = quantize_rows  # the torch reference, for tests and benchmarks

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_ONE_TILE = 16384  # widest row held whole in registers (Llama-3-8B's down_proj: 14336)
_LOOP_BLOCK_K = 4096
_ELEMENTS_PER_PROGRAM = 4096


@triton.jit(do_not_specialize=["num_rows"])
def _quantize_rows_kernel(
    # pointers
    x_ptr,
    q_ptr,
    scale_ptr,
    # sizes
    num_rows,  # T
    cols,  # K
    # strides (q is contiguous, scale is [T, 1] contiguous)
    stride_xt,
    stride_xk,
    stride_qt,
    # meta-parameters
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_TILE: tl.constexpr,  # BLOCK_K >= K: the rows stay in registers between the passes
    ROUND_IN_FP32: tl.constexpr,  # the interpreter: see fp8_tiles.py
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    row_mask = rows < num_rows
    x_rows = x_ptr + rows[:, None] * stride_xt  # [ROWS, 1]
    q_rows = q_ptr + rows[:, None] * stride_qt
    offs = tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]

    if ONE_TILE:
        mask = row_mask[:, None] & (offs < cols)
        x = tl.load(x_rows + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)  # [ROWS]; masked columns add 0
        scale = row_scale(amax)
        tl.store(scale_ptr + rows, scale, mask=row_mask)
        q = to_e4m3(x, scale[:, None], ROUND_IN_FP32)
        tl.store(q_rows + offs, q, mask=mask)
    else:
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for k0 in range(0, cols, BLOCK_K):
            mask = row_mask[:, None] & (k0 + offs < cols)
            x = tl.load(x_rows + (k0 + offs) * stride_xk, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        scale = row_scale(amax)
        tl.store(scale_ptr + rows, scale, mask=row_mask)
        for k0 in range(0, cols, BLOCK_K):
            mask = row_mask[:, None] & (k0 + offs < cols)
            x = tl.load(x_rows + (k0 + offs) * stride_xk, mask=mask, other=0.0)
            q = to_e4m3(x.to(tl.float32), scale[:, None], ROUND_IN_FP32)
            tl.store(q_rows + k0 + offs, q, mask=mask)


def _launch_config(cols: int, block_k: int | None) -> tuple[int, int, bool, int]:
    """(BLOCK_K, ROWS, ONE_TILE, num_warps) for rows of ``cols`` elements."""
    if block_k is None:
        whole = triton.next_power_of_2(cols)
        block_k = whole if whole <= _MAX_ONE_TILE else _LOOP_BLOCK_K
    one_tile = block_k >= cols
    rows = max(1, min(16, _ELEMENTS_PER_PROGRAM // block_k))
    # 16 elements a thread: 8 warps for a 4096-wide tile; 16 warps (the most) from 8192 on.
    num_warps = max(1, min(16, rows * block_k // 512))
    return block_k, rows, one_tile, num_warps


def quantize_rows_fp8(
    x: torch.Tensor,  # [T, K]
    *,
    block_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` to e4m3 with its own fp32 scale, as ``quantize_rows`` does.

    Returns new tensors (q [T, K] float8_e4m3fn contiguous, scale [T, 1] float32), with
    x ~ q * scale; mutates nothing. ``block_k`` (a power of two) forces the chunked two-pass
    path when it is below K (for tests). T == 0 launches nothing. Raises ValueError when x is
    not 2-D, has K == 0, or is not bf16 / fp16 / fp32.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_fp8: x must be [T, K], got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"quantize_rows_fp8: x dtype {x.dtype} unsupported; expected {_DTYPES}")
    t, k = x.shape
    if k == 0:
        raise ValueError("quantize_rows_fp8: rows of x are empty (K == 0): no amax to scale by")
    if block_k is not None and (block_k < 1 or block_k & (block_k - 1)):
        raise ValueError(f"quantize_rows_fp8: block_k must be a power of two, got {block_k}")
    q = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t == 0:
        return q, scale
    block, rows, one_tile, num_warps = _launch_config(k, block_k)
    _quantize_rows_kernel[(triton.cdiv(t, rows),)](
        x,
        q,
        scale,
        t,
        k,
        x.stride(0),
        x.stride(1),
        q.stride(0),
        ROWS=rows,
        BLOCK_K=block,
        ONE_TILE=one_tile,
        ROUND_IN_FP32=round_in_fp32(),
        num_warps=num_warps,
    )
    return q, scale
