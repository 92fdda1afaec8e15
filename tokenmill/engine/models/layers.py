"""Small layers shared by the model families."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in float32, then scaled by the weight in the input dtype.

    ``fused`` selects the Triton kernel (tokenmill/kernels/rms_norm.py) for 2-D inputs and
    per-head 3-D ones ([T, N, d], Qwen3's q/k norm). It also fuses the residual add:
    ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)`` and, fused,
    writes the sum into ``residual`` in place.
    """

    def __init__(self, dim: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused and x.dim() in (2, 3):
            from tokenmill.kernels.rms_norm import rms_norm

            y, summed = rms_norm(x, self.weight, self.eps, residual)
            return y if residual is None else (y, summed)
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def silu_and_mul(gate_up: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up, the halves as stacked by gate_up_proj."""
    if fused:
        from tokenmill.kernels.silu_and_mul import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
