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
