"""How a linear layer stores its weight and runs its matmul: the quantization method.

Each linear layer (linear.py) holds one method object, picked when the model is built:

    method.create_weights(layer, in_features, out_features_per_part, params_dtype, loader)
        registers the layer's parameters (a weight; an FP8 method adds scales, an INT4 one
        packed weights, scales and zeros), each carrying a ``weight_loader``
    ... the checkpoint is loaded through those loaders ...
    method.process_weights_after_loading(layer)      repack / transpose once, after loading
    method.apply(layer, x, bias)                      the layer's forward: [T, in] -> [T, out]

A method whose ``apply`` also takes its input already quantized (the FP8 method: a
``QuantizedActivation``, fp8_activation.py) says so with ``takes_fp8_input = True``; the
layer before it then writes its output quantized. A method without the attribute takes
float tensors only.

``UnquantizedMethod`` (a float weight, ``F.linear``) is the method of float layers; fp8.py,
int4.py and int8.py hold the quantized ones, and quant_methods.py picks a model's by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tokenmill.engine.models import cpu_linear
from tokenmill.engine.models.weight_loader import WeightLoader, set_weight_attrs

__all__ = ["QuantMethod", "UnquantizedMethod"]


class QuantMethod(Protocol):
    """The interface every quantization method implements (see the module docstring)."""

    def create_weights(
        self,
        layer: torch.nn.Module,
        in_features: int,
        out_features_per_part: Sequence[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        """Register ``layer``'s parameters for this rank's ``in_features`` inputs and
        ``out_features_per_part`` outputs (one entry per merged part, e.g. q, k, v), each
        with ``weight_loader`` (or a loader of the method's own, e.g. for a per-tensor scale)
        and its ``output_dim`` / ``input_dim``. ``params_dtype`` is the model's dtype."""
        ...

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Turn the loaded checkpoint layout into the one ``apply`` runs on (may mutate or
        replace ``layer``'s parameters); called once, after every tensor is loaded."""
        ...

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x`` [T, in] -> ``x W^T + bias`` [T, out] with ``layer``'s parameters."""
        ...


class UnquantizedMethod:
    """A float weight [out, in] in the model's dtype, run by ``torch.nn.functional.linear``."""

    def create_weights(
        self,
        layer: torch.nn.Module,
        in_features: int,
        out_features_per_part: Sequence[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        # weight: [sum(out_features_per_part), in_features], the parts stacked row-wise
        weight = torch.nn.Parameter(
            torch.empty(sum(out_features_per_part), in_features, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, weight_loader=weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass  # F.linear takes the checkpoint layout as it is

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return cpu_linear.linear(x, layer.weight, bias)  # F.linear but for a few CPU rows
