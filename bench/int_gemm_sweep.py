"""What the weight-only GEMM benchmarks (w4a16_gemm.py, w8a16_gemm.py) share: the tilings they
time beside the default (``choose_tiles``), and the JSON line each writes per shape and M;
fp8_gemm.py's Triton FP8 GEMM sweeps its own tilings through ``sweep``.

Small M (decode) tries long K runs and column tiles of several widths, each split over K as
the default would split it, and for M <= 4 CUDA-core sums instead of tensor-core dots
(``mma=False``); M = 64 a few mid tiles; large M big tiles without split-K.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
from triton.runtime.errors import OutOfResources

from bench.gpu_timing import time_ms
from tokenmill.kernels.int_weight_tiles import IntGemmTiles, choose_tiles

__all__ = ["shape_line", "sweep"]


def candidates(m: int, n: int, k: int, group: int) -> list[IntGemmTiles]:
    if m <= 16:
        out = []
        if m <= 4:  # CUDA-core sums: registers grow with block_m * block_n * block_k
            bm = triton.next_power_of_2(m)
            for bn in (16, 32, 64):
                split = max(1, 264 // triton.cdiv(n, bn))
                out += [IntGemmTiles(bm, bn, bk, split, 4, 3, mma=False) for bk in (64, 128, 256)
                        if bm * bn * bk <= 16384]  # fmt: skip
        for bn in (32, 64, 128):
            split = max(1, 264 // triton.cdiv(n, bn))
            out += [IntGemmTiles(16, bn, bk, split, 4, 3) for bk in (128, 256, 512)]
        split = max(1, 264 // triton.cdiv(n, 64))  # warps and pipeline depth at the default
        depths = ((2, 3), (8, 3), (4, 2), (4, 4))  # (num_warps, num_stages)
        out += [IntGemmTiles(16, 64, 256, split, w, st) for w, st in depths]
        return out
    if m <= 64:
        return [IntGemmTiles(64, bn, bk, s, 4, 3) for bn in (64, 128) for bk in (64, 128)
                for s in (1, max(1, 132 // triton.cdiv(n, bn)))]  # fmt: skip
    return [IntGemmTiles(bm, bn, bk, 1, w, 3) for bm in (64, 128) for bn in (64, 128)
            for bk in (64, 128) for w in (4, 8)]  # fmt: skip


def sweep(
    gemm: Callable[..., object],
    m: int,
    n: int,
    k: int,
    group: int,
    tilings: Sequence[IntGemmTiles] | None = None,
    default: IntGemmTiles | None = None,
) -> dict:
    """Times ``gemm(tiles=...)`` at the default tiles (``choose_tiles``' unless given) and at
    every tiling of ``tilings`` (``candidates``' unless given); returns the default's ms and
    the fastest tiling with its ms."""
    default = default or choose_tiles(m, n, k, group)
    ms = {}
    for t in candidates(m, n, k, group) if tilings is None else tilings:
        try:
            ms[t.fit(k, group)] = time_ms(lambda t=t: gemm(tiles=t), graph=True)
        except OutOfResources:  # e.g. 8-bit codes at block_n 128, block_k 512: past shared memory
            continue
    best = min(ms, key=ms.get)
    return {
        "default_tiles": list(vars(default).values()),
        "default_ms": round(time_ms(lambda: gemm(tiles=default), graph=True), 4),
        "best_tiles": list(vars(best).values()),
        "best_ms": round(ms[best], 4),
    }


def shape_line(
    name: str,
    m: int,
    kernel: str,
    gemm: Callable[..., torch.Tensor],
    dequantize_to: Callable[..., torch.Tensor],
    params: Sequence[torch.Tensor],
    weight: torch.Tensor,
    group: int,
    with_sweep: bool = True,
    code_bits: int = 8,
) -> dict:
    """One shape and M: ``gemm(x, *params)`` (named ``kernel``: "w4a16", "w8a16") against
    ``F.linear`` on the bf16 ``weight``, its tiling sweep (unless not ``with_sweep``: most of
    the time a line takes), and ``dequantize_to(*params, dtype)`` + ``F.linear`` (the large-M
    path); see the benchmarks' docstrings for the fields. ``code_bits``: the codes' width,
    which picks the default tiles the sweep reports beside its best."""
    out_f, in_f = weight.shape
    x = torch.randn(m, in_f, device=weight.device, dtype=torch.bfloat16)
    linear = torch.nn.functional.linear
    bf16_ms = time_ms(lambda: linear(x, weight), graph=True)
    kernel_ms = time_ms(lambda: gemm(x, *params), graph=True)
    tiles = {}
    if with_sweep:
        default = choose_tiles(m, out_f, in_f, group, code_bits)
        tiles = sweep(lambda **kw: gemm(x, *params, **kw), m, out_f, in_f, group, default=default)
    dequant_ms = time_ms(lambda: linear(x, dequantize_to(*params, x.dtype)), graph=True)
    dequant_only_ms = time_ms(lambda: dequantize_to(*params, x.dtype), graph=True)
    eager = {"bf16": time_ms(lambda: linear(x, weight)), kernel: time_ms(lambda: gemm(x, *params))}
    packed_bytes = sum(p.numel() * p.element_size() for p in params)
    y, want = gemm(x, *params), linear(x, weight)
    rel = ((y.float() - want.float()).norm() / want.float().norm()).item()
    return {
        "shape": name, "in": in_f, "out": out_f, "M": m,
        "bf16_ms": round(bf16_ms, 4), f"{kernel}_ms": round(kernel_ms, 4),
        "sweep": tiles,
        "dequant_ms": round(dequant_ms, 4), "dequant_only_ms": round(dequant_only_ms, 4),
        "speedup": round(bf16_ms / kernel_ms, 2),
        "best_speedup": round(bf16_ms / tiles["best_ms"], 2) if tiles else None,
        "weight_gbps": round(packed_bytes / kernel_ms / 1e6, 1),
        "rel_error": round(rel, 4),
        "eager_ms": {key: round(ms, 4) for key, ms in eager.items()},
    }  # fmt: skip
