"""Small layers shared by the model families.

Those whose output feeds a linear layer (the decoder's norms, SiLU-and-mul) take
``fp8_out``: when that layer is an FP8 one, they return their output quantized per row, a
``QuantizedActivation`` (fp8_activation.py), written by their own kernel when ``fused``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.engine.models.fp8_activation import QuantizedActivation, quantize_activation


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in float32, then scaled by the weight in the input dtype.

    ``fused`` selects the Triton kernel (tokenmill/kernels/rms_norm.py) for 2-D inputs and
    per-head 3-D ones ([T, N, d], Qwen3's q/k norm). It also fuses the residual add:
    ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)`` and, fused,
    writes the sum into ``residual`` in place. With ``fp8_out`` (2-D inputs only) the norm
    is returned as a ``QuantizedActivation`` for an FP8 linear layer.
    """

    def __init__(self, dim: int, eps: float, fused: bool = False, fp8_out: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = fused
        self.fp8_out = fp8_out

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused and self.fp8_out:
            from tokenmill.kernels.rms_norm import rms_norm_fp8

            q, scale, summed = rms_norm_fp8(x, self.weight, self.eps, residual)
            y = QuantizedActivation(q, scale)
            return y if residual is None else (y, summed)
        if self.fused and x.dim() in (2, 3):
            from tokenmill.kernels.rms_norm import rms_norm

            y, summed = rms_norm(x, self.weight, self.eps, residual)
            return y if residual is None else (y, summed)
        if residual is None:
            return self._output(self._norm(x))
        summed = x + residual
        return self._output(self._norm(summed)), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def _output(self, y: torch.Tensor) -> torch.Tensor | QuantizedActivation:
        return quantize_activation(y) if self.fp8_out else y


def silu_and_mul(
    gate_up: torch.Tensor, fused: bool = False, fp8_out: bool = False
) -> torch.Tensor | QuantizedActivation:
    """[T, 2I] -> [T, I]: silu(gate) * up, the halves as stacked by gate_up_proj; with
    ``fp8_out``, quantized per row for an FP8 linear layer (a ``QuantizedActivation``)."""
    if fused:
        from tokenmill.kernels import silu_and_mul as kernels

        if fp8_out:
            return QuantizedActivation(*kernels.silu_and_mul_fp8(gate_up))
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    y = F.silu(gate) * up
    return quantize_activation(y) if fp8_out else y
