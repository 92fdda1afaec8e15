"""INT8 weight-only linear layers (W8A16): signed 8-bit codes with a scale per group of 32
inputs, dequantized in registers by the W8A16 kernel (kernels/w8a16_gemm.py has the layout).

    parameters   qweight [out, in] int8, scales [out, in / 32] fp16
    forward      CUDA: the Triton W8A16 GEMM; CPU (the reference path): dequantize to the
                 activations' dtype and multiply

The checkpoint brings them: a GGUF file's Q8_0 blocks as they are (loader/gguf_blocks.py).
The layer's own loader shards them like a weight (rows for column-parallel layers, inputs,
and so groups, for row-parallel ones).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from tokenmill.engine.models.weight_loader import WeightLoader, set_weight_attrs

__all__ = ["Int8Method"]

GROUP = 32  # GGUF Q8_0's block


class Int8Method:
    def create_weights(
        self,
        layer: torch.nn.Module,
        in_features: int,
        out_features_per_part: Sequence[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        if in_features % GROUP:
            raise ValueError(f"{in_features} inputs are not whole groups of {GROUP} (int8 weights)")
        out = sum(out_features_per_part)
        shapes = {
            "qweight": ((out, in_features), torch.int8),
            "scales": ((out, in_features // GROUP), torch.float16),
        }
        for name, (shape, dtype) in shapes.items():
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_weight_attrs(param, weight_loader=weight_loader, output_dim=0, input_dim=1)
            layer.register_parameter(name, param)
        layer.out_dtype = params_dtype

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass  # the checkpoint's layout is the kernel's

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        gemm, dequantize = _kernels()
        if x.is_cuda:
            y = gemm(x, layer.qweight, layer.scales)
        else:
            y = torch.nn.functional.linear(x, dequantize(layer.qweight, layer.scales).to(x.dtype))
        return y if bias is None else y + bias


@functools.cache
def _kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """(the W8A16 GEMM, its dequantizing reference), imported on the first forward, not per
    layer call: building a model never needs Triton."""
    from tokenmill.kernels.w8a16_gemm import dequantize_q8, w8a16_linear

    return w8a16_linear, dequantize_q8
