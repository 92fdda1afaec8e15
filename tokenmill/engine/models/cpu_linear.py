"""Float linear layers on the CPU at a few rows: the weight as the GEMM's streamed operand.

``F.linear(x, W)`` computes x W^T. With a few rows of x (decode at small batch sizes) and a
weight too large for the caches, MKL reads W at a fraction of the memory bandwidth: one row
goes to a GEMV, 2-16 rows to a GEMM that transposes W on the way. The same product taken
as (W x^T)^T, with W the left, untransposed operand and at least two columns (one row is
sent twice), streams W at full speed. On the 2-core box, SmolLM2-135M's 30 layers and LM
head in fp32 (540 MB of weights, each read from memory once a step; /tmp-style script,
best of 5):

    rows                        1        2        5        8       32      128
    F.linear                 41.5     69.4     52.0     53.3     87.4    222.9   ms a step
    (W x^T)^T                17.9     18.4     32.3     42.7     86.0    242.1

Small weights that stay in the caches (a tiny test model's: F.linear is 1.1-1.5x faster
there) and more rows run through ``F.linear``, so only float32 weights of at least
``MIN_BYTES`` at up to ``MAX_ROWS`` rows take this path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["MAX_ROWS", "MIN_BYTES", "linear"]

MAX_ROWS = 16
MIN_BYTES = 1 << 20


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [T, in] -> x W^T + bias [T, out], as ``F.linear`` but faster for a few rows of
    a large float32 weight on the CPU (see the top)."""
    rows = x.shape[0]
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.dim() != 2
        or not 1 <= rows <= MAX_ROWS
        or weight.numel() * 4 < MIN_BYTES
    ):
        return F.linear(x, weight, bias)
    x = x if rows > 1 else x.expand(2, -1).contiguous()  # [max(T, 2), in]
    y = torch.mm(weight, x.t())[:, :rows].t().contiguous()  # [T, out]
    return y if bias is None else y.add_(bias)
