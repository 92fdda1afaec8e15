"""INT4 weight-only linear layers (W4A16): 4-bit codes with a scale and a min per group of
inputs, dequantized in registers by the W4A16 kernel (kernels/w4a16_gemm.py has the layout).

    parameters   qweight [out, in / 2] uint8, scales and mins [out, in / group] fp16
    forward      CUDA: the Triton W4A16 GEMM below 64 tokens; from 64 on, the Triton
                 dequantization into the activations' dtype and a 16-bit GEMM, which measured
                 faster there (H200, Llama-3-8B shapes, BENCHMARKS.md session 13: 1.5-2.2x
                 on three of the four at M = 64, 3-6x on all four at M = 256); CPU (the
                 reference path): dequantize to the activations' dtype and multiply

The checkpoint brings them: GGUF Q4_0 / Q4_1 blocks as they are (groups of 32,
loader/gguf_blocks.py), or GPTQ / AWQ layers repacked at load (their group size,
loader/awq_gptq.py). The layer's own loader shards them like a weight (rows for
column-parallel layers, inputs, and so groups, for row-parallel ones).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.engine.models.block_weights import BlockWeightMethod
from tokenmill.engine.models.weight_loader import WeightLoader

__all__ = ["Int4Method"]


class Int4Method(BlockWeightMethod):
    PARAMS = ("qweight", "scales", "mins")
    KERNELS = ("tokenmill.kernels.w4a16_gemm", "w4a16_linear", "dequantize_q4")
    LARGE_M = ("tokenmill.kernels.q4_dequantize", "dequantize_q4_rows", 64)

    def __init__(self, group: int = 32) -> None:
        if group < 32 or group % 32:
            raise ValueError(f"Int4Method: the group size must be a multiple of 32, got {group}")
        self.group = group

    def create_weights(
        self,
        layer: torch.nn.Module,
        in_features: int,
        out_features_per_part: Sequence[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        if in_features % self.group:
            raise ValueError(
                f"{in_features} inputs are not whole groups of {self.group} (int4 weights)"
            )
        out = sum(out_features_per_part)
        shapes = {
            "qweight": ((out, in_features // 2), torch.uint8),
            "scales": ((out, in_features // self.group), torch.float16),
            "mins": ((out, in_features // self.group), torch.float16),
        }
        self._register(layer, shapes, params_dtype, weight_loader)
