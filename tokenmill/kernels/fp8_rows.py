"""Per-row FP8 (e4m3) quantization in plain torch: the reference of the Triton kernel in
fp8_quant.py, and the FP8 layers' path on CPU; pure torch, no Triton.

    scale[r] = max(max_c |x[r, c]| / 448, 1e-12)        q[r, c] = e4m3(x[r, c] / scale[r])

448 is e4m3's largest finite value, so nothing saturates; 1e-12 keeps an all-zero row from
dividing by 0 (any scale gives it zeros).
"""

from __future__ import annotations

import torch

__all__ = ["FP8", "FP8_MAX", "MIN_SCALE", "quantize_rows"]

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
MIN_SCALE = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [R, C], fp32 scales [R, 1]) with x ~ values * scales, one scale a row."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    # Divided by a tensor, not the number: CUDA divides a tensor by a Python number as a
    # multiplication by its reciprocal, 1 ulp off a true division (the kernel's) at times.
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)
    return (x.float() / scale).to(FP8), scale
