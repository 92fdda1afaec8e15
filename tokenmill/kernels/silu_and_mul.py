"""SiLU-gated product of the MLP's fused gate/up projection.

    x = [ gate (I) | up (I) ]   ->   y = silu(gate) * up,   silu(g) = g / (1 + exp(-g))

computed in float32 with CUDA's own exp and an IEEE division, and rounded where the engine's
torch ``silu_and_mul`` rounds: silu(gate) to x's dtype, then the product, so both backends
give the same bits.

Shapes:
    x: [T, 2I]  rows may be strided, the last dim must be contiguous
    y: [T, I]   new (or caller's ``out``)

Kernel: a 2-D grid (token, column block); each program reads BLOCK gate and BLOCK up values
of one token and writes BLOCK outputs.

``silu_and_mul_fp8`` quantizes y per row to e4m3 for an FP8 linear layer (the MLP's
down_proj) in the same pass; its reference is ``quantize_rows`` of y:

    q      [T, I]  e4m3fn    q[t, i]  = e4m3(clamp(y[t, i] / scale[t], -448, 448))
    scale  [T, 1]  fp32      scale[t] = max(max_i |y[t, i]| / 448, 1e-12)

y is rounded to x's dtype first and widened back to fp32 (exactly), which is what
``quantize_rows(y)`` reads; with fp8_tiles.py's IEEE divisions and round-to-nearest-even
cast, q and scale equal ``quantize_rows(y)`` bit for bit, and y is the plain kernel's y (an
element-wise formula: no order of operations changes with the tiling). A scale needs the
whole row's amax, so a program owns whole rows, or its rows' columns are spread over
programs of a second kernel file:

    I <= 4096   one tile [ROWS, BLOCK], BLOCK = next_power_of_2(I): y stays in registers
                from the amax to the store (one pass)
    I >  4096   the column split (silu_and_mul_fp8_split.py, 1,024 columns a program): the
                fastest path at Llama-3-8B's 14,336 at every T measured on the H200
                (bench/fp8_gemm.py, session 16: T=16 0.0081 ms against the one tile's
                0.0122, T=256 0.0182 / 0.0214, T=8192 0.348 / 0.526, the two loops 0.342)
    ``block``   (tests, benchmarks) one tile when block >= I, else two loops over I in
                chunks of BLOCK: y and its amax, then y again (re-read, mostly from L2,
                and recomputed) and its store
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels.fp8_rows import FP8, quantize_rows
from tokenmill.kernels.fp8_tiles import round_in_fp32, row_scale, to_e4m3
from tokenmill.kernels.silu_and_mul_fp8_split import silu_and_mul_fp8_split
from tokenmill.kernels.silu_times import cuda_exp, silu_times_at

__all__ = ["silu_and_mul", "silu_and_mul_fp8", "silu_and_mul_fp8_ref", "silu_and_mul_ref"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8_MAX_ONE_TILE = 4096  # widest row the default path keeps in one program's registers
_FP8_SPLIT_COLUMNS = 1024  # the column split's chunk for wider rows (see the top)
_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _silu_and_mul_kernel(
    # pointers
    x_ptr,
    out_ptr,
    # sizes
    inter,
    # strides (rows; the last dims are contiguous)
    stride_xt,
    stride_ot,
    # meta-parameters
    BLOCK: tl.constexpr,
    CUDA_EXP: tl.constexpr,  # False in the interpreter, which has no libdevice (numpy's exp)
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + t * stride_xt
    y = silu_times_at(row, cols, mask, inter, out_ptr.dtype.element_ty, CUDA_EXP)
    tl.store(out_ptr + t * stride_ot + cols, y, mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _silu_and_mul_fp8_kernel(
    # pointers
    x_ptr,
    q_ptr,
    scale_ptr,
    y_ptr,  # WRITE_Y: [T, I] in x's dtype
    # sizes
    num_rows,  # T
    inter,  # I
    # strides (rows; the last dims are contiguous)
    stride_xt,
    stride_qt,
    stride_yt,
    # meta-parameters
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_TILE: tl.constexpr,  # BLOCK >= I: y stays in registers between amax and store
    WRITE_Y: tl.constexpr,
    CUDA_EXP: tl.constexpr,  # False in the interpreter
    ROUND_IN_FP32: tl.constexpr,  # the interpreter's e4m3 cast: see fp8_tiles.py
):
    dtype = x_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    row_mask = rows < num_rows
    gate_rows = x_ptr + rows[:, None] * stride_xt  # [ROWS, 1]; up is I further
    q_rows = q_ptr + rows[:, None] * stride_qt
    y_rows = y_ptr + rows[:, None] * stride_yt
    offs = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]

    if ONE_TILE:
        mask = row_mask[:, None] & (offs < inter)
        y = silu_times_at(gate_rows, offs, mask, inter, dtype, CUDA_EXP)
        if WRITE_Y:
            tl.store(y_rows + offs, y, mask=mask)
        yf = y.to(tl.float32)  # the rounded y, exactly: what quantize_rows(y) reads
        scale = row_scale(tl.max(tl.abs(yf), axis=1))  # [ROWS]
        tl.store(scale_ptr + rows, scale, mask=row_mask)
        tl.store(q_rows + offs, to_e4m3(yf, scale[:, None], ROUND_IN_FP32), mask=mask)
    else:
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for i0 in range(0, inter, BLOCK):
            mask = row_mask[:, None] & (i0 + offs < inter)
            y = silu_times_at(gate_rows + i0, offs, mask, inter, dtype, CUDA_EXP)
            if WRITE_Y:
                tl.store(y_rows + i0 + offs, y, mask=mask)
            amax = tl.maximum(amax, tl.max(tl.abs(y.to(tl.float32)), axis=1))
        scale = row_scale(amax)
        tl.store(scale_ptr + rows, scale, mask=row_mask)
        for i0 in range(0, inter, BLOCK):
            # y again, recomputed: the same formula gives the same bits
            mask = row_mask[:, None] & (i0 + offs < inter)
            yf = silu_times_at(gate_rows + i0, offs, mask, inter, dtype, CUDA_EXP).to(tl.float32)
            q = to_e4m3(yf, scale[:, None], ROUND_IN_FP32)
            tl.store(q_rows + i0 + offs, q, mask=mask)


def _launch_config(inter: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the widest power-of-two column block <= 1024 that tiles I without
    a ragged tail, and 8 elements (16 bytes of bf16) of each half a thread."""
    block = 1024
    while block > 128 and inter % block:
        block //= 2
    block = min(block, triton.next_power_of_2(inter))
    return block, max(1, block // 256)


def _fp8_launch_config(inter: int, block: int | None) -> tuple[int, int, bool, int]:
    """(BLOCK, ROWS, ONE_TILE, num_warps) of the FP8 kernel for rows of I outputs."""
    if block is None:
        block = triton.next_power_of_2(inter)
    rows = max(1, min(16, _ELEMENTS_PER_PROGRAM // block))
    # 16 outputs (32 inputs) a thread: 8 warps for a 4096-wide tile, 16 (the most) past it
    num_warps = max(1, min(16, rows * block // 512))
    return block, rows, block >= inter, num_warps


def _check_x(x: torch.Tensor) -> tuple[int, int]:
    """(T, I) of x [T, 2I] after checks; ValueError names the mismatch."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2I] (even last dim); got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype {x.dtype} unsupported; expected one of {_DTYPES}")
    if x.stride(1) != 1:
        raise ValueError(f"x must be contiguous in its last dim; strides {x.stride()}")
    return x.shape[0], x.shape[1] // 2


def _checked_out(out: torch.Tensor | None, x: torch.Tensor, t: int, inter: int) -> torch.Tensor:
    """The caller's ``out`` [T, I] after checks, or a new tensor in x's dtype."""
    if out is None:
        return torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if (
        tuple(out.shape) != (t, inter)
        or out.dtype != x.dtype
        or out.device != x.device
        or (inter > 1 and out.stride(1) != 1)
    ):
        raise ValueError(
            f"out must be a {x.dtype} [T, I] = {(t, inter)} tensor on {x.device}, contiguous in "
            f"its last dim; got {out.dtype} {tuple(out.shape)} strides {out.stride()} "
            f"on {out.device}"
        )
    return out


def silu_and_mul(
    x: torch.Tensor,  # [T, 2I]
    out: torch.Tensor | None = None,  # [T, I]
) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] as a [T, I] tensor in x's dtype.

    Writes only the result: ``out`` if given, else a new tensor; x is read. Raises
    ValueError on shape, dtype, device or stride mismatches.
    """
    t, inter = _check_x(x)
    out = _checked_out(out, x, t, inter)
    if t == 0 or inter == 0:
        return out
    block, num_warps = _launch_config(inter)
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
        x,
        out,
        inter,
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        CUDA_EXP=cuda_exp(),
        num_warps=num_warps,
    )
    return out


def silu_and_mul_fp8(
    x: torch.Tensor,  # [T, 2I]
    *,
    out: torch.Tensor | None = None,  # [T, I] in x's dtype
    block: int | None = None,
    split_columns: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`silu_and_mul`'s y quantized per row to e4m3 for an FP8 linear layer, in one
    pass over x.

    Returns new tensors (q [T, I] float8_e4m3fn contiguous, scale [T, 1] float32), equal to
    ``quantize_rows(y)``. y itself is written only into ``out``, when given (tests,
    benchmarks); x is read. ``block`` (a power of two) forces the two-loop path when it is
    below I, the one-tile path when it is not (tests, benchmarks); ``split_columns`` (a
    power of two) runs the column-split path of silu_and_mul_fp8_split.py with that many
    columns a program, which is the default for I > 4096 (see the top). Raises ValueError
    on shape, dtype, device or stride mismatches, for I == 0 (no amax to scale by) and for
    a ``block`` or ``split_columns`` not a power of two.
    """
    t, inter = _check_x(x)
    if inter == 0:
        raise ValueError("silu_and_mul_fp8: rows of x are empty (I == 0): no amax to scale by")
    for name, value in (("block", block), ("split_columns", split_columns)):
        if value is not None and (value < 1 or value & (value - 1)):
            raise ValueError(f"silu_and_mul_fp8: {name} must be a power of two, got {value}")
    if out is not None:
        out = _checked_out(out, x, t, inter)
    q = torch.empty(t, inter, dtype=FP8, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t == 0:
        return q, scale
    if split_columns is None and block is None and inter > _FP8_MAX_ONE_TILE:
        split_columns = _FP8_SPLIT_COLUMNS
    if split_columns is not None:
        silu_and_mul_fp8_split(x, q, scale, out, split_columns)
        return q, scale
    block, rows, one_tile, num_warps = _fp8_launch_config(inter, block)
    y = out if out is not None else q  # never touched when WRITE_Y is False
    _silu_and_mul_fp8_kernel[(triton.cdiv(t, rows),)](
        x,
        q,
        scale,
        y,
        t,
        inter,
        x.stride(0),
        q.stride(0),
        y.stride(0),
        ROWS=rows,
        BLOCK=block,
        ONE_TILE=one_tile,
        WRITE_Y=out is not None,
        CUDA_EXP=cuda_exp(),
        ROUND_IN_FP32=round_in_fp32(),
        num_warps=num_warps,
    )
    return q, scale


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The engine's torch path: silu(gate) * up in x's dtype; x: [T, 2I] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of :func:`silu_and_mul_fp8`: ``quantize_rows`` of
    :func:`silu_and_mul_ref`'s y, (q [T, I] e4m3, scale [T, 1] fp32)."""
    return quantize_rows(silu_and_mul_ref(x))
