"""e4m3 arithmetic on Triton tiles, shared by every kernel that writes rows as FP8 with one
fp32 scale a row: the row quantizer (fp8_quant.py) and the producers that quantize their own
output in the pass that computes it (rms_norm_fp8 in rms_norm.py, silu_and_mul_fp8 in
silu_and_mul.py). Each is tested bit for bit against ``quantize_rows`` (fp8_rows.py):

    scale = max(amax / 448, 1e-12)              ``row_scale``: an IEEE division (tl.div_rn),
                                                as torch divides by a tensor
    q     = e4m3(clamp(x / scale, -448, 448))   ``to_e4m3``: an IEEE division, then a cast
                                                that rounds to nearest even

Compiled, the fp32 -> e4m3 cast rounds to nearest even, like torch's. The interpreter's does
not (ties away from zero; a carry into the exponent lost: 31.5 -> 16, not 32), so under
``TRITON_INTERPRET=1`` the kernels round on e4m3's grid in fp32 first (``round_in_fp32()``
says when), which leaves the cast exact.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from tokenmill.kernels.fp8_rows import FP8_MAX, MIN_SCALE

__all__ = ["round_in_fp32", "row_scale", "to_e4m3"]

E4M3_MAX = tl.constexpr(FP8_MAX)  # 448: nothing saturates
SCALE_FLOOR = tl.constexpr(MIN_SCALE)  # an all-zero row must not divide by 0


def round_in_fp32() -> bool:
    """The value for the kernels' ``ROUND_IN_FP32``: True in the interpreter (see above)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def row_scale(amax):
    """fp32 amax [ROWS] of each row -> its scale [ROWS]."""
    return tl.maximum(tl.div_rn(amax, E4M3_MAX), SCALE_FLOOR)


@triton.jit
def _round_to_e4m3_grid(v):
    """fp32 ``v`` (|v| <= 448) rounded to nearest even on e4m3's grid, still fp32, so the
    cast that follows is exact. Only for the interpreter."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF  # biased
    # e4m3 keeps 3 mantissa bits down to 2^-6 (biased fp32 exponent 121), then steps of 2^-9
    step = ((tl.maximum(exponent, 121) - 3) << 23).to(tl.float32, bitcast=True)
    # |v| + 1.5 * 2^23 steps lies in a binade whose ulp is one step: the add rounds |v| to
    # whole steps, nearest even, and the subtraction is exact.
    magic = step * 12582912.0
    r = (tl.abs(v) + magic) - magic
    sign = (bits >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x, scale, ROUND_IN_FP32: tl.constexpr):
    """fp32 x [ROWS, BLOCK] / scale [ROWS, 1] as e4m3 [ROWS, BLOCK]."""
    v = tl.clamp(tl.div_rn(x, scale), -E4M3_MAX, E4M3_MAX)
    if ROUND_IN_FP32:
        v = _round_to_e4m3_grid(v)
    return v.to(tl.float8e4nv)
