"""silu(gate) * up for one tile of the SiLU-and-mul kernels (silu_and_mul.py and
silu_and_mul_fp8_split.py), rounded as the engine's torch path rounds."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["silu_times"]


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
