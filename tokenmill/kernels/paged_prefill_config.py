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


def default_prefill_config(
    head_dim: int, dtype: torch.dtype, fresh: bool = False
) -> PrefillAttentionConfig:
    """Hopper (H100/H200) tiles per head dim; a small fixed tile in the interpreter.

    Every head dim up to 128 reads the step's own keys from k_new/v_new (``read_new_keys``).
    Measured on the H200 in bf16 on fresh prompts (BENCHMARKS.md):
    - d = 128 (32/8 heads, session 3): 128x128 tiles, 8 warps, 2 stages. 357/408/441 TFLOP/s
      at 2k/4k/8k with block_size 16 (the block-table gather path gave 330-356 at 4k-8k) and
      356/408/427 with block_size 128, against SDPA's flash backend at 302/322/332.
    - d = 64 (SmolLM2's 9/3 heads, session 4): 128x64 tiles, 3 stages; 8 warps when the
      caller promises ``fresh`` (290/331/373 TFLOP/s at block_size 16, where 4 warps reading
      every key through the table gave 211/239/265 and SDPA 221/241/253), else 4 warps (with
      the block-table code compiled in, 4 warps gave 255/303/358 and 8 warps 226/274/312; on
      chunks over a cached context, 169-227 against 146-165).
    d = 256: 64x32, 8 warps, 2 stages. fp32 halves BLOCK_N (twice the bytes per element).
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return PrefillAttentionConfig(
            block_m=32, block_n=16, num_warps=4, num_stages=1, read_new_keys=True
        )
    if head_dim <= 64:
        cfg = PrefillAttentionConfig(
            block_m=128, block_n=64, num_warps=8 if fresh else 4, num_stages=3, read_new_keys=True
        )
    elif head_dim <= 128:
        cfg = PrefillAttentionConfig(
            block_m=128, block_n=128, num_warps=8, num_stages=2, read_new_keys=True
        )
    else:
        cfg = PrefillAttentionConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    if dtype == torch.float32:
        cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2), num_stages=2)
    return cfg
