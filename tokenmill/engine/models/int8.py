"""INT8 weight-only linear layers (W8A16): signed 8-bit codes with a scale per group of 32
inputs, dequantized in registers by the W8A16 kernel (kernels/w8a16_gemm.py has the layout).

    parameters   qweight [out, in] int8, scales [out, in / 32] fp16
    forward      CUDA: the Triton W8A16 GEMM below 64 tokens; from 64 on, the Triton
                 dequantization into the activations' dtype and a 16-bit GEMM (as int4.py
                 does; for int8 predicted from its GEMM's 9x bf16 time at M = 256, not yet
                 measured); CPU (the reference path): dequantize to the activations' dtype
                 and multiply

The checkpoint brings them: a GGUF file's Q8_0 blocks as they are (loader/gguf_blocks.py).
The layer's own loader shards them like a weight (rows for column-parallel layers, inputs,
and so groups, for row-parallel ones).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.engine.models.block_weights import BlockWeightMethod
from tokenmill.engine.models.weight_loader import WeightLoader

__all__ = ["Int8Method"]

GROUP = 32  # GGUF Q8_0's block


class Int8Method(BlockWeightMethod):
    PARAMS = ("qweight", "scales")
    KERNELS = ("tokenmill.kernels.w8a16_gemm", "w8a16_linear", "dequantize_q8")
    LARGE_M = ("tokenmill.kernels.q8_dequantize", "dequantize_q8_rows", 64)

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
        self._register(layer, shapes, params_dtype, weight_loader)
