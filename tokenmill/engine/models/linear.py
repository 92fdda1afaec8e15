"""Linear layers whose weight is split over tensor-parallel ranks, and their weight loaders.

    ColumnParallelLinear(in, out)            rank r: W rows [r*out/tp, (r+1)*out/tp)
                                             x [T, in] -> its slice of y [T, out/tp]
    MergedColumnParallelLinear(in, (a, b))   several column-parallel projections of one input,
                                             one matmul: W = [A_r; B_r]  [(a+b)/tp, in]
    RowParallelLinear(in, out)               rank r: W columns [r*in/tp, (r+1)*in/tp)
                                             its slice of x [T, in/tp] -> y [T, out], summed
                                             over the ranks (all-reduce), bias added once

A column-parallel layer feeding a row-parallel one (qkv -> attention -> o, gate_up -> down)
needs no communication between them. Merged q/k/v under GQA with tp=2 (Q = Hq*d, K = Hkv*d):

    checkpoint        q_proj [Q, H]     k_proj [K, H]     v_proj [K, H]
    rank 0 qkv_proj   [ q[:Q/2]       | k[:K/2]         | v[:K/2]       ]   [(Q+2K)/2, H]
    rank 1 qkv_proj   [ q[Q/2:]       | k[K/2:]         | v[K/2:]       ]

Each layer's parameters come from its QuantMethod (quantization.py) and carry a weight loader
(``ColumnWeightLoader`` / ``RowWeightLoader``) that takes the whole checkpoint tensor, checks its
shape and keeps this rank's slice. With ``tp_size=1`` every layer holds the full matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.engine.models.fp8_activation import QuantizedActivation
from tokenmill.engine.models.quant_methods import new_quant_method
from tokenmill.engine.models.quantization import QuantMethod
from tokenmill.engine.models.weight_loader import (
    WeightLoader,
    check_shape,
    default_weight_loader,
    set_weight_attrs,
)
from tokenmill.engine.parallel import ParallelConfig

__all__ = [
    "LinearBase",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "RowParallelLinear",
    "ColumnWeightLoader",
    "RowWeightLoader",
]


@dataclass(frozen=True)
class ColumnWeightLoader:
    """Fills a column-parallel parameter: this rank's rows of each part, along ``output_dim``.

    ``rows_per_part``: this rank's output features of each part (q, k, v), in parameter order.
    A parameter without ``output_dim`` (a per-tensor value) is copied whole.
    """

    rows_per_part: tuple[int, ...]
    tp_rank: int
    tp_size: int

    def __call__(
        self, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:
            default_weight_loader(param, loaded)
            return
        if shard_id is None:
            if len(self.rows_per_part) > 1:
                raise ValueError(
                    f"is loaded whole, but its parameter merges {len(self.rows_per_part)} parts"
                )
            shard_id = 0
        rows = self.rows_per_part[shard_id]
        target = param.data.narrow(dim, sum(self.rows_per_part[:shard_id]), rows)
        full = list(target.shape)
        full[dim] = rows * self.tp_size
        check_shape(loaded, tuple(full))
        target.copy_(loaded.narrow(dim, self.tp_rank * rows, rows))


@dataclass(frozen=True)
class RowWeightLoader:
    """Fills a row-parallel parameter: this rank's columns along ``input_dim``.

    A parameter without ``input_dim`` (the bias, added after the all-reduce) is copied whole.
    """

    tp_rank: int
    tp_size: int

    def __call__(
        self, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is None:
            default_weight_loader(param, loaded, shard_id)
            return
        if shard_id is not None:
            raise ValueError(f"is part {shard_id} of a merged weight, but this layer has no parts")
        cols = param.shape[dim]
        full = list(param.shape)
        full[dim] = cols * self.tp_size
        check_shape(loaded, tuple(full))
        param.data.copy_(loaded.narrow(dim, self.tp_rank * cols, cols))


class LinearBase(torch.nn.Module):
    """``y = x W^T + b`` with parameters made and applied by ``quant_method``.

    ``in_features`` and ``output_sizes`` (one per merged part) are the checkpoint's, unsplit;
    the subclasses say which of them this rank holds a slice of. ``weight`` (and ``bias``) are
    this rank's shard; ``weight_loader`` fills them from whole checkpoint tensors.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        parallel: ParallelConfig | None,
        quant_method: QuantMethod | None,
        params_dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.parallel = parallel or ParallelConfig()
        self.tp_rank = self.parallel.tp_rank
        self.tp_size = self.parallel.tp_size
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.quant_method: QuantMethod = quant_method or new_quant_method()
        self.params_dtype = params_dtype or torch.get_default_dtype()

    @property
    def takes_fp8_input(self) -> bool:
        """Whether ``forward`` also takes x already quantized per row (a
        ``QuantizedActivation``: the FP8 method), so the kernel producing x may write it so
        (fp8_activation.py). False for methods that do not say (quantization.py)."""
        return getattr(self.quant_method, "takes_fp8_input", False)

    def _create_params(
        self, in_per_rank: int, out_per_rank: tuple[int, ...], bias: bool, loader: WeightLoader
    ) -> None:
        self.weight_loader = loader
        self.quant_method.create_weights(self, in_per_rank, out_per_rank, self.params_dtype, loader)
        if bias:
            # bias: [sum(out_per_rank)], sharded like the weight's rows where they are
            b = torch.nn.Parameter(
                torch.empty(sum(out_per_rank), dtype=self.params_dtype), requires_grad=False
            )
            set_weight_attrs(b, weight_loader=loader, output_dim=0)
            self.bias = b
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, output_sizes={self.output_sizes}, "
            f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}, "
            f"quant_method={type(self.quant_method).__name__}"
        )


class MergedColumnParallelLinear(LinearBase):
    """Column-parallel projections of one input stacked into one matmul (q/k/v, gate/up).

    ``output_sizes`` may differ (GQA's q is wider than k and v); each must divide by
    ``tp_size``. Checkpoint tensors load one part at a time: ``shard_id`` is the part index.
    ``forward``: x [T, in] -> [T, sum(output_sizes)/tp], this rank's rows of each part in turn.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        *,
        parallel: ParallelConfig | None = None,
        quant_method: QuantMethod | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, output_sizes, bias, parallel, quant_method, params_dtype)
        rows = tuple(self.parallel.per_rank(n, "output size") for n in self.output_sizes)
        loader = ColumnWeightLoader(rows, self.tp_rank, self.tp_size)
        self._create_params(in_features, rows, bias, loader)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(MergedColumnParallelLinear):
    """A column-parallel projection of one part: x [T, in] -> this rank's [T, out/tp]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        parallel: ParallelConfig | None = None,
        quant_method: QuantMethod | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            in_features,
            (out_features,),
            bias,
            parallel=parallel,
            quant_method=quant_method,
            params_dtype=params_dtype,
        )


class RowParallelLinear(LinearBase):
    """Rank r holds input columns [r*in/tp, (r+1)*in/tp): x [T, in/tp] -> y [T, out].

    With ``tp_size > 1`` each rank's product is a partial sum; ``forward`` all-reduces it over
    the default process group unless ``reduce_results=False`` (the caller sums). The bias is
    added on rank 0 only, so the sum holds it once.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        reduce_results: bool = True,
        parallel: ParallelConfig | None = None,
        quant_method: QuantMethod | None = None,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, (out_features,), bias, parallel, quant_method, params_dtype)
        self.reduce_results = reduce_results
        cols = self.parallel.per_rank(in_features, "input size")
        loader = RowWeightLoader(self.tp_rank, self.tp_size)
        self._create_params(cols, (out_features,), bias, loader)

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.reduce_results and self.tp_size > 1:
            torch.distributed.all_reduce(y)
        return y
