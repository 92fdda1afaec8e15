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
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["silu_and_mul", "silu_and_mul_ref"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    g = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # CUDA's expf and an IEEE division, as torch's silu: tl.exp and `/` are approximations
    # whose last bits differ from them (0.03% of fp16 outputs off).
    if CUDA_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    s = tl.math.div_rn(g, 1.0 + e)
    s = s.to(out_ptr.dtype.element_ty).to(tl.float32)
    y = s * u
    tl.store(out_ptr + t * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_config(inter: int) -> tuple[int, int]:
    """(BLOCK, num_warps): the widest power-of-two column block <= 1024 that tiles I without
    a ragged tail, and 8 elements (16 bytes of bf16) of each half a thread."""
    block = 1024
    while block > 128 and inter % block:
        block //= 2
    block = min(block, triton.next_power_of_2(inter))
    return block, max(1, block // 256)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2I]
    out: torch.Tensor | None = None,  # [T, I]
) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] as a [T, I] tensor in x's dtype.

    Writes only the result: ``out`` if given, else a new tensor; x is read. Raises
    ValueError on shape, dtype, device or stride mismatches.
    """
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2I] (even last dim); got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype {x.dtype} unsupported; expected one of {_DTYPES}")
    if x.stride(1) != 1:
        raise ValueError(f"x must be contiguous in its last dim; strides {x.stride()}")
    t, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    elif (
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
        CUDA_EXP=os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=num_warps,
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The engine's torch path: silu(gate) * up in x's dtype; x: [T, 2I] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
