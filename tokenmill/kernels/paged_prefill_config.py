"""Launch parameters of the paged prefill attention kernel, and the measured defaults.

Kept apart from the kernel (paged_prefill_attention.py) so the tuning record reads on its
own; the kernel module re-exports both names.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

__all__ = ["PrefillAttentionConfig", "default_prefill_config"]


@dataclass(frozen=True)
class PrefillAttentionConfig:
    """Launch parameters. ``block_m`` counts query rows (tokens x packed heads) per program."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    pack_gqa: bool = True  # put the query heads of one KV head in the same tile
    # Read the keys of this step's own tokens from ``k_new``/``v_new`` (rows in token order)
    # instead of through the block table; the cached context still goes through the table.
    # Same values, so the same result; it spares the per-key block-id gather (block sizes
    # below BLOCK_N) and, for a batch of fresh prompts, every block-table lookup.
    read_new_keys: bool = False

    def __post_init__(self) -> None:
        for key in ("block_m", "block_n"):
            value = getattr(self, key)
            if value < 16 or value & (value - 1):
                raise ValueError(f"PrefillAttentionConfig.{key}={value}: need a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"PrefillAttentionConfig.num_warps={self.num_warps}: need 1-16, pow2")
        if self.num_stages < 1:
            raise ValueError(f"PrefillAttentionConfig.num_stages={self.num_stages}: need >= 1")


def default_prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillAttentionConfig:
    """Hopper (H100/H200) tiles per head dim; a small fixed tile in the interpreter.

    d <= 64: 128x64 tiles, 4 warps. d = 128: 128x128 tiles, 8 warps, 2 stages, and the
    step's own keys read from k_new/v_new (``read_new_keys``), for every block size.
    Measured on the H200 at 32/8 heads, bf16, fresh prompts (BENCHMARKS.md, session 3):
    357/408/441 TFLOP/s at 2k/4k/8k with block_size 16 (the block-table gather path gave
    330-356 at 4k-8k) and 356/408/427 with block_size 128, against SDPA's flash backend at
    302/322/332. d = 256: 64x32, 8 warps, 2 stages. fp32 halves BLOCK_N (twice the bytes per
    element).
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return PrefillAttentionConfig(
            block_m=32, block_n=16, num_warps=4, num_stages=1, read_new_keys=True
        )
    if head_dim <= 64:
        cfg = PrefillAttentionConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    elif head_dim <= 128:
        cfg = PrefillAttentionConfig(
            block_m=128, block_n=128, num_warps=8, num_stages=2, read_new_keys=True
        )
    else:
        cfg = PrefillAttentionConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    if dtype == torch.float32:
        cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2), num_stages=2)
    return cfg
