"""FP8 W8A8 linear layers: e4m3 weights with a scale per output channel, activations
quantized per token on the fly, one scaled matmul.

    load:    W [out, in] in the model's dtype (the checkpoint's, or GGUF dequantized)
    after:   s_w[o] = max|W[o, :]| / 448             W_q = e4m3(W / s_w)      [out, in]
    forward: s_x[t] = max|x[t, :]| / 448             x_q = e4m3(x / s_x)      [T, in]
             y = (x_q @ W_q^T) * s_x[:, None] * s_w[None, :]   (+ bias)       [T, out]

448 is e4m3's largest finite value, so nothing saturates. The product runs with fp32
accumulation in ``torch._scaled_mm`` (cuBLAS's fp8 tensor-core kernels; a plain path on CPU),
or, on CUDA for up to ``TRITON_MAX_ROWS`` rows, in the Triton kernel kernels/fp8_gemm.py:
whichever the H200 measured faster at that size (see ``TRITON_MAX_ROWS``).
``fp8_linear_reference`` writes the same arithmetic out in fp32 for tests.
Weights take half the bytes of bf16, and decode, bound by reading them, gets faster. The LM
head and the embeddings stay in the model's dtype (they are not linear layers here).

On CUDA one Triton kernel quantizes the activations (kernels/fp8_quant.py), equal bit for bit
to ``quantize_rows``, which stays the CPU path and the reference. Where the kernel before the
layer can write its output as FP8 itself (RMSNorm before qkv and gate_up, SiLU-and-mul before
down), ``apply`` takes that ``QuantizedActivation`` instead and quantizes nothing
(fp8_activation.py).

A pre-quantized FP8 checkpoint (``checkpoint=True``) brings W_q itself, as e4m3 ``weight``
tensors with a ``weight_scale`` per output channel ([out, 1] or [out]) or per tensor (one
value, the same for every row of that part: q, k and v each have their own).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenmill.engine.models.fp8_activation import QuantizedActivation, quantize_activation
from tokenmill.engine.models.quantization import UnquantizedMethod
from tokenmill.engine.models.weight_loader import WeightLoader, set_weight_attrs
from tokenmill.kernels.fp8_rows import FP8, FP8_MAX, quantize_rows

__all__ = [
    "FP8_MAX",
    "TRITON_MAX_ROWS",
    "Fp8Method",
    "fp8_linear_reference",
    "quantize_rows",
    "takes_triton_gemm",
]

# Products of up to this many rows run in the Triton kernel, larger ones in cuBLAS. On the
# H200 (bench/fp8_gemm.py --no-sweep, session 16) Triton was faster on every Llama-3-8B shape
# at M = 16 and 64 (qkv 0.0138 against 0.0212 ms at 16, down 0.0292 against 0.0401 at 64: a
# decode-sized product is bound by reading the weight, and cuBLAS's fp8 kernels are not tuned
# for it) and slower on three of four from M = 256 (compute-bound; up to 2x at M >= 2,048).
# A row's bits thus depend on whether its step has more than 64 rows, as they already did on
# cuBLAS's own choice of kernel by M.
TRITON_MAX_ROWS = 64


@dataclass(frozen=True)
class _ScaleLoader:
    """Loads a checkpoint's ``weight_scale`` into the layer's [out, 1] scales: a per-channel
    scale as it is, a per-tensor one repeated over its part's ``full_rows`` (the checkpoint's
    rows of each part), both through the layer's own (sharding) loader."""

    inner: WeightLoader
    full_rows: tuple[int, ...]

    def __call__(
        self, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        rows = self.full_rows[shard_id or 0]
        if tuple(loaded.shape) not in ((), (1,), (rows,), (rows, 1)):
            raise ValueError(
                f"weight_scale has shape {list(loaded.shape)}; an FP8 checkpoint's scale is "
                f"per tensor ([] or [1]) or per output channel ([{rows}] or [{rows}, 1])"
            )
        loaded = loaded.float().reshape(-1, 1)
        if loaded.shape[0] == 1:
            loaded = loaded.expand(rows, 1)
        self.inner(param, loaded, shard_id)


class Fp8Method(UnquantizedMethod):
    """Loads a float weight like the unquantized method, then quantizes it (see above); or,
    with ``checkpoint``, loads a pre-quantized e4m3 weight and its scales."""

    takes_fp8_input = True  # apply takes a QuantizedActivation: its producer may quantize

    def __init__(self, checkpoint: bool = False) -> None:
        self.checkpoint = checkpoint

    def create_weights(
        self,
        layer: torch.nn.Module,
        in_features: int,
        out_features_per_part: Sequence[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        layer.out_dtype = params_dtype
        if not self.checkpoint:
            super().create_weights(
                layer, in_features, out_features_per_part, params_dtype, weight_loader
            )
            return
        out = sum(out_features_per_part)
        weight = torch.nn.Parameter(torch.empty(out, in_features, dtype=FP8), requires_grad=False)
        set_weight_attrs(weight, weight_loader=weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)
        # Column-parallel loaders keep this rank's rows of each part; a row-parallel layer
        # holds every output row.
        rows = getattr(weight_loader, "rows_per_part", None)
        tp = getattr(weight_loader, "tp_size", 1)
        full = tuple(r * tp for r in rows) if rows else tuple(out_features_per_part)
        scale = torch.nn.Parameter(torch.empty(out, 1, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, weight_loader=_ScaleLoader(weight_loader, full), output_dim=0)
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.checkpoint:
            q, scale = layer.weight.data, layer.weight_scale.data
        else:
            q, scale = quantize_rows(layer.weight.data)
        # [in, out] column-major, as _scaled_mm takes its second operand
        layer.weight = torch.nn.Parameter(q.t(), requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale.t().contiguous(), requires_grad=False)

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor | QuantizedActivation,  # [T, in]
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if not isinstance(x, QuantizedActivation):
            x = quantize_activation(x)  # [T, in] e4m3, [T, 1] fp32
        if x.values.is_cuda and takes_triton_gemm(*x.values.shape):
            w_q = layer.weight.t()  # [out, in] row-major: the weight is its column-major view
            y = _triton_fp8_gemm()(x.values, x.scales, w_q, layer.weight_scale, layer.out_dtype)
        else:
            y = torch._scaled_mm(
                x.values,
                layer.weight,
                scale_a=x.scales,
                scale_b=layer.weight_scale,
                out_dtype=layer.out_dtype,
            )  # [T, out]
        return y if bias is None else y + bias


def takes_triton_gemm(rows: int, in_features: int) -> bool:
    """Whether a CUDA product of ``rows`` activations runs in the Triton kernel (else in
    ``_scaled_mm``): up to ``TRITON_MAX_ROWS`` rows, where K is a multiple of its tiles (32;
    ``_scaled_mm`` takes any multiple of 16)."""
    return rows <= TRITON_MAX_ROWS and in_features % 32 == 0


@functools.cache
def _triton_fp8_gemm() -> Callable[..., torch.Tensor]:
    """The Triton FP8 GEMM, imported on the first CUDA forward that takes it: building a
    model, or running it on CPU, never needs Triton."""
    from tokenmill.kernels.fp8_gemm import fp8_gemm

    return fp8_gemm


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The FP8 layer's arithmetic in fp32 from a float ``weight`` [out, in]: both operands
    quantized per row as above, dequantized, multiplied (for tests; not fast)."""
    x_q, sx = quantize_rows(x)
    w_q, sw = quantize_rows(weight)
    y = (x_q.float() * sx) @ (w_q.float() * sw).t()
    return y if bias is None else y + bias.float()
