"""FP8 W8A8 linear layers against bf16 on the Llama-3-8B layer shapes (issue 14's GEMM goal).

For each shape (qkv, o, gate_up, down) and token count M: the bf16 ``F.linear`` and the FP8
layer's forward (``Fp8Method.apply``: per-token activation quantization included, then
``torch._scaled_mm`` with per-channel weight scales), each timed with a cold L2 (gpu_timing).
Prints ms, TFLOP/s and the FP8 / bf16 speed-up per row, and the FP8 output's error relative
to the bf16 one. Goal: >= 1.7x at M >= 2048.

The FP8 forward's two parts are also timed alone, to show where its time goes:
``quant_ms`` the activation quantization it runs (the Triton kernel, kernels/fp8_quant.py),
``torch_quant_ms`` the torch reference it replaced (``quantize_rows``), and ``mm_ms``
``torch._scaled_mm`` on activations quantized beforehand.

    PYTHONPATH=. python bench/fp8_gemm.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_timing import time_ms, warm_up_gpu  # noqa: E402
from tokenmill.engine.models.fp8 import Fp8Method  # noqa: E402
from tokenmill.engine.models.linear import RowParallelLinear  # noqa: E402
from tokenmill.kernels.fp8_quant import quantize_rows_fp8, quantize_rows_fp8_ref  # noqa: E402

SHAPES = {  # name: (in, out) of Llama-3-8B's linear layers
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
}


def fp8_layer(weight: torch.Tensor) -> RowParallelLinear:
    out_f, in_f = weight.shape
    layer = RowParallelLinear(in_f, out_f, quant_method=Fp8Method(), params_dtype=weight.dtype)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def scaled_mm(layer: RowParallelLinear, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """The FP8 forward's matmul alone, on activations quantized beforehand: [T, out]."""
    return torch._scaled_mm(x_q, layer.weight, scale_a=x_scale, scale_b=layer.weight_scale,
                            out_dtype=layer.out_dtype)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,256,2048,4096,8192")
    args = parser.parse_args()
    warm_up_gpu()
    for name, (in_f, out_f) in SHAPES.items():
        weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
        layer = fp8_layer(weight.clone())
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
            with torch.inference_mode():
                bf16_ms = time_ms(lambda x=x, w=weight: torch.nn.functional.linear(x, w))
                fp8_ms = time_ms(lambda x=x, f=layer: f(x))
                quant_ms = time_ms(lambda x=x: quantize_rows_fp8(x))
                torch_quant_ms = time_ms(lambda x=x: quantize_rows_fp8_ref(x))
                x_q, x_scale = quantize_rows_fp8(x)
                mm_ms = time_ms(lambda q=x_q, s=x_scale, f=layer: scaled_mm(f, q, s))
                ref = torch.nn.functional.linear(x, weight).float()
                err = ((layer(x).float() - ref).norm() / ref.norm()).item()
            flop = 2 * m * in_f * out_f
            print(json.dumps({
                "shape": name, "in": in_f, "out": out_f, "M": m,
                "bf16_ms": round(bf16_ms, 4), "fp8_ms": round(fp8_ms, 4),
                "bf16_tflops": round(flop / bf16_ms / 1e9, 1),
                "fp8_tflops": round(flop / fp8_ms / 1e9, 1),
                "speedup": round(bf16_ms / fp8_ms, 2), "rel_error": round(err, 4),
                "quant_ms": round(quant_ms, 4), "torch_quant_ms": round(torch_quant_ms, 4),
                "mm_ms": round(mm_ms, 4),
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
