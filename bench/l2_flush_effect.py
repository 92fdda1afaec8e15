"""How the way L2 is flushed between timed calls changes a bandwidth figure (GPU).

Times RoPE (T=4096 and 16384), RMSNorm + residual and a copy of the same bytes four ways:
``triton.testing.do_bench`` (it zeroes a 256 MB buffer before each call), and
``bench.gpu_timing.time_ms`` with the same zeroing flush, with its own read flush (a sum over
256 MB, leaving L2 clean), and with no flush. Prints % of the 4.25 TB/s copy ceiling.

    PYTHONPATH=$PWD python3 bench/l2_flush_effect.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import kernel_bench_elementwise as ew  # noqa: E402
from bench.gpu_timing import time_ms, warm_up_gpu  # noqa: E402
from tokenmill.kernels.rms_norm import rms_norm  # noqa: E402
from tokenmill.kernels.rope import rope_  # noqa: E402

CEILING_TBPS = 4.25


def _copy(nbytes: int) -> Callable[[], Any]:
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _cases(t: int, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple[str, Callable, int]]:
    """(name, call, bytes it must move) for RoPE, RMSNorm + residual and same-size copies."""
    hq, hkv, d, h = ew.N_HEADS, ew.N_KV, ew.HEAD_DIM, ew.HIDDEN
    qkv = torch.randn(t, hq + 2 * hkv, d, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
    pos = torch.randperm(ew.MAX_POSITIONS, device="cuda")[:t]
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(h, device="cuda", dtype=torch.bfloat16)
    rope_bytes = ew.rope_bytes(t, hq, hkv, d, 2)
    norm_bytes = ew.rms_norm_bytes(t, h, 2)
    return [
        ("rope_", lambda: rope_(q, k, pos, cos, sin), rope_bytes),
        ("copy of rope's bytes", _copy(rope_bytes), rope_bytes),
        ("rms_norm+residual", lambda: rms_norm(x, w, ew.EPS, res), norm_bytes),
        ("copy of rms's bytes", _copy(norm_bytes), norm_bytes),
    ]


def main() -> None:
    warm_up_gpu(2.0)
    zero_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    cos, sin = ew._rope_tables()
    print(
        f"{'op':<24} {'T':>6} {'do_bench':>9} {'zeroing':>8} {'read':>8} {'none':>8}  (% of 4.25)"
    )
    for t in (4096, 16384):
        for name, fn, nbytes in _cases(t, cos, sin):
            times = [
                triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"),
                time_ms(fn, before=zero_buf.zero_),
                time_ms(fn),
                time_ms(fn, before=None),
            ]
            pcts = [100 * nbytes / (ms * 1e-3) / 1e12 / CEILING_TBPS for ms in times]
            print(f"{name:<24} {t:>6} " + " ".join(f"{p:>8.1f}" for p in pcts), flush=True)


if __name__ == "__main__":
    main()
