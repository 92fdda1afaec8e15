"""An activation already quantized per row for an FP8 linear layer, and where it comes from.

An FP8 layer (fp8.py) multiplies e4m3 activations, one fp32 scale a row. Quantizing them in
a pass of their own reads the activation back from memory, 10-20% of the FP8 GEMM's time at
M >= 2048 (BENCHMARKS.md, session 9). So where the kernel that produces the activation has
the whole row in hand, it writes the e4m3 row and its scale itself:

    producer                    consumer        the producer's FP8 kernel
    input_layernorm (+ add)  -> qkv_proj        rms_norm_fp8      (kernels/rms_norm.py)
    post_attention_layernorm -> gate_up_proj    rms_norm_fp8
    silu_and_mul             -> down_proj       silu_and_mul_fp8  (kernels/silu_and_mul.py)
    attention                -> o_proj          none: the layer quantizes its input itself

The seam: a model builds each producer with ``fp8_out=consumer.takes_fp8_input`` (a linear
layer's property, from its quantization method); such a producer returns a
``QuantizedActivation`` instead of a tensor, and ``Fp8Method.apply`` takes either. The
unquantized and INT4 methods never see one.

Both ways give the same bits. The fused kernels quantize their own output after rounding it
to the model's dtype, with ``quantize_rows``' arithmetic (fp8_rows.py); the unfused paths
(torch on CPU, or the plain kernels) hand their output to ``quantize_activation``, which is
what the FP8 layer would have run on it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.kernels.fp8_rows import quantize_rows

__all__ = ["QuantizedActivation", "quantize_activation"]


@dataclass(frozen=True)
class QuantizedActivation:
    """x [T, K] as e4m3 ``values`` [T, K] and fp32 ``scales`` [T, 1]: x ~ values * scales."""

    values: torch.Tensor  # [T, K] float8_e4m3fn
    scales: torch.Tensor  # [T, 1] float32


def quantize_activation(x: torch.Tensor) -> QuantizedActivation:
    """x [T, K] quantized per row: the Triton kernel on CUDA, ``quantize_rows`` elsewhere
    (the two agree bit for bit). Returns new tensors; x is only read."""
    quantize = _cuda_quantize_rows() if x.is_cuda else quantize_rows
    return QuantizedActivation(*quantize(x))


@functools.cache
def _cuda_quantize_rows() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The Triton row quantizer, imported on the first CUDA forward, not per call: building
    a model, or running it on CPU, never needs Triton."""
    from tokenmill.kernels.fp8_quant import quantize_rows_fp8

    return quantize_rows_fp8
