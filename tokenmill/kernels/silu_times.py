"""silu(gate) * up for one tile of the SiLU-and-mul kernels (silu_and_mul.py and
silu_and_mul_fp8_split.py), rounded as the engine's torch path rounds."""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["cuda_exp", "silu_times", "silu_times_at"]


def cuda_exp() -> bool:
    """The kernels' ``CUDA_EXP``: False in the interpreter, which has no libdevice."""
    return os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def silu_times(g, u, DTYPE: tl.constexpr, CUDA_EXP: tl.constexpr):
    """silu(g) * u for fp32 g and u, rounded to DTYPE where torch rounds (see silu_and_mul.py)."""
    # CUDA's expf and an IEEE division, as torch's silu: tl.exp and `/` are approximations
    # whose last bits differ from them (0.03% of fp16 outputs off).
    if CUDA_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)  # the interpreter has no libdevice (numpy's exp)
    s = tl.math.div_rn(g, 1.0 + e)
    s = s.to(DTYPE).to(tl.float32)
    return (s * u).to(DTYPE)


@triton.jit
def silu_times_at(gate, offs, mask, inter, DTYPE: tl.constexpr, CUDA_EXP: tl.constexpr):
    """``silu_times`` of the gate values at ``gate + offs`` and the up values I further
    (``inter``), loaded where ``mask`` holds (0 elsewhere: silu(0) * 0 = 0)."""
    g = tl.load(gate + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + inter + offs, mask=mask, other=0.0).to(tl.float32)
    return silu_times(g, u, DTYPE, CUDA_EXP)
