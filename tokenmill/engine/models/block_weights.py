"""What the weight-only integer methods share (int4.py, int8.py): the layer holds the
checkpoint's codes and per-group scales (and, for int4, mins) as they are; a kernel multiplies
by them on CUDA, and the CPU reference path dequantizes them to the activations' dtype and
multiplies.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

from tokenmill.engine.models.weight_loader import WeightLoader, set_weight_attrs

__all__ = ["BlockWeightMethod"]

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]  # parameter -> (shape, dtype)


class BlockWeightMethod:
    """A subclass names its parameters in ``PARAMS`` (in the order its kernels take them),
    registers their shapes with ``_register``, and names its kernels in ``KERNELS``: the
    module and, in it, the CUDA GEMM (x and the parameters -> y) and the reference (the
    parameters -> the fp32 weight), imported on the first forward (building a model never
    needs Triton)."""

    PARAMS: tuple[str, ...] = ()
    KERNELS: tuple[str, str, str] = ("", "", "")
    # (module, function, M): from M tokens on, CUDA dequantizes the weight with the function
    # (the parameters and a dtype -> the weight) and runs a 16-bit GEMM, where that measured
    # faster than the GEMM kernel; None: the kernel at every M.
    LARGE_M: tuple[str, str, int] | None = None

    def kernels(self) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
        return _kernels(*self.KERNELS)

    def _register(
        self,
        layer: torch.nn.Module,
        shapes: Shapes,
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        """Each of PARAMS loads like a weight: rows are outputs, columns inputs (or groups)."""
        for name in self.PARAMS:
            shape, dtype = shapes[name]
            param = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_weight_attrs(param, weight_loader=weight_loader, output_dim=0, input_dim=1)
            layer.register_parameter(name, param)
        layer.out_dtype = params_dtype

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass  # the checkpoint's layout is the kernel's

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        gemm, dequantize = self.kernels()
        params = [getattr(layer, name) for name in self.PARAMS]
        if x.is_cuda and self.LARGE_M is not None and x.shape[0] >= self.LARGE_M[2]:
            dequantize_to = _function(*self.LARGE_M[:2])
            y = torch.nn.functional.linear(x, dequantize_to(*params, x.dtype))
        elif x.is_cuda:
            y = gemm(x, *params)
        else:
            y = torch.nn.functional.linear(x, dequantize(*params).to(x.dtype))
        return y if bias is None else y + bias


@functools.cache
def _function(module: str, name: str) -> Callable[..., torch.Tensor]:
    return getattr(importlib.import_module(module), name)


def _kernels(
    module: str, gemm: str, dequantize: str
) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    return _function(module, gemm), _function(module, dequantize)
