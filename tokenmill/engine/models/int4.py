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
loader/awq_gptq.py). An act-order GPTQ layer (``act_order``) also holds ``perm`` [in] int32,
its inputs sorted by group: the forward multiplies x[:, perm] by the rows. The parts of a
merged layer (q/k/v, gate/up) share their input, so they must share its order; and a
row-parallel layer split over tensor-parallel ranks would need other ranks' inputs, so act-order
is refused there. The layer's own loader shards them like a weight (rows for
column-parallel layers, inputs, and so groups, for row-parallel ones).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.engine.models.block_weights import BlockWeightMethod
from tokenmill.engine.models.weight_loader import WeightLoader, check_shape, set_weight_attrs

__all__ = ["Int4Method"]


class Int4Method(BlockWeightMethod):
    PARAMS = ("qweight", "scales", "mins")
    KERNELS = ("tokenmill.kernels.w4a16_gemm", "w4a16_linear", "dequantize_q4")
    LARGE_M = ("tokenmill.kernels.q4_dequantize", "dequantize_q4_rows", 64)

    def __init__(self, group: int = 32, act_order: bool = False) -> None:
        if group < 32 or group % 32:
            raise ValueError(f"Int4Method: the group size must be a multiple of 32, got {group}")
        self.group = group
        self.act_order = act_order

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
        if self.act_order:
            splits_inputs = getattr(weight_loader, "rows_per_part", None) is None
            if splits_inputs and getattr(weight_loader, "tp_size", 1) > 1:
                raise ValueError(
                    "act-order (desc_act) GPTQ layers cannot be split by input over "
                    "tensor-parallel ranks: run this checkpoint with tensor_parallel_size 1"
                )
            perm = torch.nn.Parameter(torch.empty(in_features, dtype=torch.int32),
                                      requires_grad=False)  # fmt: skip
            set_weight_attrs(perm, weight_loader=_PermLoader())
            layer.register_parameter("perm", perm)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.act_order and layer.perm.weight_loader.loaded is None:  # random weights
            layer.perm.data.copy_(torch.arange(layer.perm.numel(), dtype=torch.int32))

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.act_order:
            x = x.index_select(-1, layer.perm)
        return super().apply(layer, x, bias)


class _PermLoader:
    """Loads an act-order layer's ``perm``: whole, and for a merged layer once per part, each
    part's equal to the first's (they share one input)."""

    def __init__(self) -> None:
        self.loaded: torch.Tensor | None = None
        self.first_part: int | None = None

    def __call__(
        self, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        check_shape(loaded, tuple(param.shape))
        if self.loaded is None:
            self.loaded, self.first_part = loaded.cpu().clone(), shard_id
            param.data.copy_(loaded)
        elif not torch.equal(self.loaded, loaded.cpu()):
            raise ValueError(
                f"orders its inputs (act-order g_idx) unlike part {self.first_part} of the same "
                "merged layer: layers merged into one (q/k/v, gate/up) read one input, so they "
                "must share its order"
            )
