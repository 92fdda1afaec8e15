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
    """[T, 2I] -> [T, I]: silu(gate) * up, the halves as stacked by MergedLinear."""
    if fused:
        from tokenmill.kernels.silu_and_mul import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class MergedLinear(torch.nn.Linear):
    """One matmul for several HF projections that share an input (q/k/v, gate/up).

    The weight is the row-wise concatenation of the parts; ``load_part`` copies one HF tensor
    into its rows so checkpoints load without a merged copy.
    """

    def __init__(self, in_features: int, part_sizes: tuple[int, ...], bias: bool) -> None:
        super().__init__(in_features, sum(part_sizes), bias=bias)
        self.part_sizes = part_sizes

    def load_part(self, index: int, name: str, tensor: torch.Tensor, is_bias: bool) -> None:
        start = sum(self.part_sizes[:index])
        size = self.part_sizes[index]
        target = (self.bias if is_bias else self.weight)[start : start + size]
        if tensor.shape != target.shape:
            raise ValueError(
                f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
