"""Llama-3-8B's linear layers, as (in, out) features: the shapes the GEMM benches time."""

from __future__ import annotations

LINEAR_SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (4096, 6144),  # 32 query + 2 x 8 KV heads of 128
    "o": (4096, 4096),
    "gate_up": (4096, 28672),  # 2 x 14336
    "down": (14336, 4096),
}
