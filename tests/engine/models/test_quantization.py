"""The quantization-method seam: the unquantized method, and layers that go through theirs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tokenmill.engine.models.linear import MergedColumnParallelLinear, RowParallelLinear
from tokenmill.engine.models.quantization import UnquantizedMethod
from tokenmill.engine.models.weight_loader import WeightLoader, default_weight_loader
from tokenmill.engine.parallel import ParallelConfig


def test_unquantized_method_makes_a_float_weight_with_its_loader() -> None:
    layer = torch.nn.Module()
    method = UnquantizedMethod()
    method.create_weights(layer, 4, (3, 5), torch.float16, default_weight_loader)
    weight = layer.weight
    assert weight.shape == (8, 4) and weight.dtype == torch.float16
    assert not weight.requires_grad
    assert weight.weight_loader is default_weight_loader
    assert (weight.output_dim, weight.input_dim) == (0, 1)
    weight.data.copy_(torch.randn(8, 4))
    method.process_weights_after_loading(layer)
    x, b = torch.randn(2, 4, dtype=torch.float16), torch.randn(8, dtype=torch.float16)
    assert torch.equal(method.apply(layer, x, b), F.linear(x, weight, b))


class _RecordingMethod(UnquantizedMethod):
    """A stand-in for issue 14's methods: records what the layer asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def create_weights(
        self,
        layer: torch.nn.Module,
        in_features: int,
        out_features_per_part: Sequence[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        self.calls.append(("create", in_features, tuple(out_features_per_part), params_dtype))
        super().create_weights(
            layer, in_features, out_features_per_part, params_dtype, weight_loader
        )

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        self.calls.append(("apply", tuple(x.shape), bias is not None))
        return super().apply(layer, x, bias)


def test_layers_create_and_run_through_their_method_with_this_ranks_sizes() -> None:
    rank1 = ParallelConfig(tp_rank=1, tp_size=2)
    qkv_method, o_method = _RecordingMethod(), _RecordingMethod()
    qkv = MergedColumnParallelLinear(
        16, (16, 8, 8), bias=True, parallel=rank1, quant_method=qkv_method
    )
    o = RowParallelLinear(
        16, 16, bias=True, reduce_results=False, parallel=rank1, quant_method=o_method
    )
    torch.nn.init.normal_(qkv.weight)
    torch.nn.init.normal_(o.weight)
    qkv(torch.randn(3, 16))
    o(torch.randn(3, 8))
    assert qkv_method.calls == [
        ("create", 16, (8, 4, 4), torch.float32),
        ("apply", (3, 16), True),
    ]
    # Rank 1 of a row-parallel layer leaves the bias to rank 0.
    assert o_method.calls == [("create", 8, (16,), torch.float32), ("apply", (3, 8), False)]
