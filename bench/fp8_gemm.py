"""FP8 W8A8 linear layers against bf16 on the Llama-3-8B layer shapes (issue 14's GEMM goal).

Two lines per shape (qkv, o, gate_up, down) and token count M, each call timed with a cold
L2, replaying a CUDA graph of it as the engine's decode steps do (gpu_timing: launched from
Python, a few-microsecond GEMM is timed with its host launch work; ``eager_ms`` on the
"layer" line is bf16 and FP8 timed that way). Goal: >= 1.7x at M >= 2048, activation
quantization included.

``"line": "layer"`` -- the layer alone: the bf16 ``F.linear`` against the FP8 layer's forward
on a bf16 input (``Fp8Method.apply``: the activation quantization kernel, then
``torch._scaled_mm`` with per-channel weight scales). Its parts are also timed alone:
``quant_ms`` the quantization kernel (kernels/fp8_quant.py), ``torch_quant_ms`` its torch
reference (``quantize_rows``), ``mm_ms`` ``torch._scaled_mm`` on activations quantized
beforehand, ``triton_mm_ms`` the Triton FP8 GEMM (kernels/fp8_gemm.py) on the same ones
(``triton_vs_mm_error`` its output against _scaled_mm's; ``triton_sweep`` at M <= 512 its
default and best tilings). ``rel_error``: the FP8 output's error relative to the bf16 one.

``"line": "fused_producer"`` -- the layer with the kernel that produces its input, as the
model runs them (fp8_activation.py):

    qkv, gate_up  bf16: rms_norm (+ residual add) then F.linear
                  FP8:  rms_norm_fp8 (the norm written as e4m3 rows + scales) then _scaled_mm
    down          bf16: silu_and_mul then F.linear
                  FP8:  silu_and_mul_fp8 then _scaled_mm
    o             attention produces its input: the FP8 layer quantizes it (as "layer")

``speedup`` compares the pairs; ``gemm_speedup`` = bf16 linear / (FP8 pair - bf16
producer): the FP8 GEMM charged with what quantizing its input adds to the producer, the
goal's "activation quantization included". ``unfused_fp8_ms``: the bf16 producer, then the
FP8 layer quantizing for itself (the path before the fused producers). For down,
``producer_fp8_loop_ms`` times silu_and_mul_fp8 with its ``block``: the two-loop path at 2048
and 4096, the one tile at 16384, against the default (``producer_fp8_ms``: the column split
of 1,024 columns at I = 14336), and ``producer_fp8_split_ms`` the column split at other
widths (``split_columns``, kernels/silu_and_mul_fp8_split.py): which is fastest at I = 14336,
and at which M, decides the default (the top of kernels/silu_and_mul.py).

    python3 bench/fp8_gemm.py [--tokens 16,256,2048,4096,8192] [--no-sweep]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_timing import time_ms, warm_up_gpu  # noqa: E402
from bench.int_gemm_sweep import sweep  # noqa: E402
from bench.llama8b_shapes import LINEAR_SHAPES  # noqa: E402
from tokenmill.engine.models.fp8 import Fp8Method  # noqa: E402
from tokenmill.engine.models.linear import RowParallelLinear  # noqa: E402
from tokenmill.kernels.fp8_gemm import choose_fp8_tiles, fp8_gemm  # noqa: E402
from tokenmill.kernels.fp8_quant import quantize_rows_fp8, quantize_rows_fp8_ref  # noqa: E402
from tokenmill.kernels.int_weight_tiles import IntGemmTiles  # noqa: E402
from tokenmill.kernels.rms_norm import rms_norm, rms_norm_fp8  # noqa: E402
from tokenmill.kernels.silu_and_mul import silu_and_mul, silu_and_mul_fp8  # noqa: E402

SHAPES = LINEAR_SHAPES  # name: (in, out)
PRODUCERS = {"qkv": "rms_norm+residual", "o": "attention (not fused)",
             "gate_up": "rms_norm+residual", "down": "silu_and_mul"}  # fmt: skip
EPS = 1e-5
LOOP_BLOCKS = (2048, 4096, 16384)  # silu_and_mul_fp8's two loops; 16384: its one tile
SPLIT_COLUMNS = (1024, 2048, 4096)  # its column-split path (silu_and_mul_fp8_split.py)
MAX_SWEEP_M = 512  # decode batches: where the Triton FP8 GEMM's tilings are swept


@dataclass(frozen=True)
class Producer:
    """One layer with the kernel producing its input, as callables over fixed inputs."""

    bf16_pair: Callable[[], torch.Tensor]  # bf16 producer, then F.linear
    fp8_pair: Callable[[], torch.Tensor]  # FP8 producer (writes e4m3 rows), then _scaled_mm
    unfused_fp8: Callable[[], torch.Tensor]  # bf16 producer, then the FP8 layer quantizing
    bf16_producer: Callable[[], object] | None  # None: attention (not timed here)
    fp8_producer: Callable[..., object] | None  # silu_and_mul_fp8 also takes its path
    reset: Callable[[], object] = lambda: None  # the inputs as they were (the residual)


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


def producer(name: str, m: int, weight: torch.Tensor, layer: RowParallelLinear) -> Producer:
    """``name``'s layer (bf16 ``weight`` and its FP8 ``layer``) with its producer, M tokens."""
    in_f = weight.shape[1]
    linear = torch.nn.functional.linear
    if name == "down":
        gate_up = torch.randn(m, 2 * in_f, device="cuda", dtype=torch.bfloat16) * 3
        return Producer(
            bf16_pair=lambda: linear(silu_and_mul(gate_up), weight),
            fp8_pair=lambda: scaled_mm(layer, *silu_and_mul_fp8(gate_up)),
            unfused_fp8=lambda: layer(silu_and_mul(gate_up)),
            bf16_producer=lambda: silu_and_mul(gate_up),
            fp8_producer=lambda **path: silu_and_mul_fp8(gate_up, **path),
        )
    x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
    if name == "o":
        return Producer(lambda: linear(x, weight), lambda: layer(x), lambda: layer(x), None, None)
    # The norm adds x into the residual in place, call after call: growing, harmlessly.
    residual = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
    start = residual.clone()
    norm_w = 1 + 0.1 * torch.randn(in_f, device="cuda", dtype=torch.bfloat16)
    return Producer(
        bf16_pair=lambda: linear(rms_norm(x, norm_w, EPS, residual)[0], weight),
        fp8_pair=lambda: scaled_mm(layer, *rms_norm_fp8(x, norm_w, EPS, residual)[:2]),
        unfused_fp8=lambda: layer(rms_norm(x, norm_w, EPS, residual)[0]),
        bf16_producer=lambda: rms_norm(x, norm_w, EPS, residual),
        fp8_producer=lambda: rms_norm_fp8(x, norm_w, EPS, residual),
        reset=lambda: residual.copy_(start),
    )


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return ((got.float() - want).norm() / want.norm()).item()


def layer_line(
    name: str, m: int, weight: torch.Tensor, layer: RowParallelLinear, max_sweep_m: int
) -> dict:
    in_f, out_f = weight.shape[1], weight.shape[0]
    x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
    bf16_ms = time_ms(lambda: torch.nn.functional.linear(x, weight), graph=True)
    fp8_ms = time_ms(lambda: layer(x), graph=True)
    x_q, x_scale = quantize_rows_fp8(x)
    flop = 2 * m * in_f * out_f
    return {
        "line": "layer", "shape": name, "in": in_f, "out": out_f, "M": m,
        "bf16_ms": round(bf16_ms, 4), "fp8_ms": round(fp8_ms, 4),
        "bf16_tflops": round(flop / bf16_ms / 1e9, 1),
        "fp8_tflops": round(flop / fp8_ms / 1e9, 1),
        "speedup": round(bf16_ms / fp8_ms, 2),
        "rel_error": round(rel_error(layer(x), torch.nn.functional.linear(x, weight)), 4),
        "quant_ms": round(time_ms(lambda: quantize_rows_fp8(x), graph=True), 4),
        "torch_quant_ms": round(time_ms(lambda: quantize_rows_fp8_ref(x), graph=True), 4),
        "mm_ms": round(time_ms(lambda: scaled_mm(layer, x_q, x_scale), graph=True), 4),
        **triton_columns(layer, x_q, x_scale, max_sweep_m),
        "eager_ms": {
            "bf16": round(time_ms(lambda: torch.nn.functional.linear(x, weight)), 4),
            "fp8": round(time_ms(lambda: layer(x)), 4),
        },
    }  # fmt: skip


def fp8_tilings(m: int, n: int, k: int) -> list[IntGemmTiles]:
    """Tilings of the Triton FP8 GEMM tried at decode batches: 64 or 128 columns, K runs of
    128 or 256, split over K to about 1, 2 or 4 programs per SM, 3 or 4 pipeline stages."""
    tilings = [
        IntGemmTiles(64, bn, bk, max(1, per_sm * 132 // (triton.cdiv(m, 64) * n // bn)), 4, st)
        for bn in (64, 128) for bk in (128, 256) for per_sm in (1, 2, 4) for st in (3, 4)
    ]  # fmt: skip
    return list(dict.fromkeys(t.fit(k, k) for t in tilings))  # splits that fit K, once each


def triton_columns(
    layer: RowParallelLinear, x_q: torch.Tensor, x_scale: torch.Tensor, max_sweep_m: int
) -> dict:
    """The Triton FP8 GEMM (kernels/fp8_gemm.py) on the same quantized activations as
    ``mm_ms``: its default tiles, and at M <= ``max_sweep_m`` the sweep's best tiling."""
    w_q, w_scale = layer.weight.t(), layer.weight_scale  # [N, K] rows, [1, N]
    m, (n, k) = x_q.shape[0], w_q.shape

    def gemm(**kw):
        return fp8_gemm(x_q, x_scale, w_q, w_scale, layer.out_dtype, **kw)

    want = scaled_mm(layer, x_q, x_scale).float()
    err = ((gemm().float() - want).norm() / want.norm()).item()
    cols = {"triton_mm_ms": round(time_ms(gemm, graph=True), 4), "triton_vs_mm_error": err}
    if m <= max_sweep_m:
        cols["triton_sweep"] = sweep(
            gemm, m, n, k, k, fp8_tilings(m, n, k), default=choose_fp8_tiles(m, n, k)
        )
    return cols


def producer_line(
    name: str, m: int, weight: torch.Tensor, layer: RowParallelLinear, linear_ms: float
) -> dict:
    """The "fused_producer" line (see the module docstring); ``linear_ms``: bf16 F.linear."""
    p = producer(name, m, weight, layer)
    p.reset()
    fp8_out = p.fp8_pair()
    p.reset()
    err = rel_error(fp8_out, p.bf16_pair())
    bf16_ms, fp8_ms = time_ms(p.bf16_pair, graph=True), time_ms(p.fp8_pair, graph=True)
    producer_ms = time_ms(p.bf16_producer, graph=True) if p.bf16_producer else 0.0
    gemm_ms = fp8_ms - producer_ms  # the FP8 GEMM and what quantizing adds to the producer
    line = {
        "line": "fused_producer", "shape": name, "M": m, "producer": PRODUCERS[name],
        "bf16_ms": round(bf16_ms, 4), "fp8_ms": round(fp8_ms, 4),
        "speedup": round(bf16_ms / fp8_ms, 2),
        "gemm_speedup": round(linear_ms / gemm_ms, 2) if gemm_ms > 0 else None,
        "unfused_fp8_ms": round(time_ms(p.unfused_fp8, graph=True), 4),
        "producer_bf16_ms": round(producer_ms, 4), "rel_error": round(err, 4),
    }  # fmt: skip
    if p.fp8_producer is not None:
        line["producer_fp8_ms"] = round(time_ms(p.fp8_producer, graph=True), 4)
    if name == "down":
        paths = {"loop": ("block", LOOP_BLOCKS), "split": ("split_columns", SPLIT_COLUMNS)}
        for key, (kw, values) in paths.items():
            line[f"producer_fp8_{key}_ms"] = {
                v: round(time_ms(lambda a={kw: v}: p.fp8_producer(**a), graph=True), 4)
                for v in values
            }
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,256,2048,4096,8192")
    parser.add_argument("--no-sweep", action="store_true", help="only the Triton default tiles")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, a subset")
    args = parser.parse_args()
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"--shapes: unknown {sorted(unknown)}; the shapes are {list(SHAPES)}")
    max_sweep_m = 0 if args.no_sweep else MAX_SWEEP_M
    warm_up_gpu()
    for name in args.shapes.split(","):
        in_f, out_f = SHAPES[name]
        weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02
        layer = fp8_layer(weight.clone())
        for m in (int(t) for t in args.tokens.split(",")):
            with torch.inference_mode():
                line = layer_line(name, m, weight, layer, max_sweep_m)
                print(json.dumps(line), flush=True)
                fused = producer_line(name, m, weight, layer, line["bf16_ms"])
                print(json.dumps(fused), flush=True)


if __name__ == "__main__":
    main()
