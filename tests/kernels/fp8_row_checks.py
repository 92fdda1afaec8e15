"""The check the FP8-producing kernels' tests share: their e4m3 rows and per-row scales are
exactly ``quantize_rows`` of their own rounded output."""

from __future__ import annotations

import torch

from tokenmill.kernels.fp8_rows import quantize_rows


def assert_fp8_rows_of(q: torch.Tensor, scale: torch.Tensor, y: torch.Tensor) -> None:
    q_ref, scale_ref = quantize_rows(y)
    assert q.dtype == torch.float8_e4m3fn and q.shape == y.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (y.shape[0], 1)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())  # -0 == +0; every other bit pattern equal


def assert_fp8_rows_near(
    q: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, max_share: float = 1e-4
) -> None:
    """The compiled RMSNorm check: ``quantize_rows(y)`` but for a few values one e4m3 step
    away. Compiled for CUDA, the kernel may sum a row's squares in another order than the
    plain RMSNorm did (and recompute it for the quantizing half), so its own y can be an ulp
    off ``y`` and a value near a rounding tie lands on the neighbouring e4m3 step."""
    q_ref, scale_ref = quantize_rows(y)
    assert q.dtype == torch.float8_e4m3fn and q.shape == y.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (y.shape[0], 1)
    torch.testing.assert_close(scale, scale_ref, rtol=2**-7, atol=0)  # a bf16 ulp of amax
    a, b = q.float(), q_ref.float()
    mag = torch.maximum(a.abs(), b.abs()).clamp_min(2**-6)  # e4m3 subnormals: steps of 2^-9
    step = torch.exp2(torch.floor(torch.log2(mag)) - 3)  # 3 mantissa bits
    assert bool(((a - b).abs() <= step).all()), "an e4m3 value more than one step away"
    assert (a != b).float().mean().item() <= max_share
