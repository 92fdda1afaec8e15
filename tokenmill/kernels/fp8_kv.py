"""The FP8 KV cache's rounding, shared by the Triton store (kv_store.py) and the torch
backend; pure torch, no Triton.

An FP8 cache (float8_e4m3fn, ``engine.kv_cache_dtype: fp8``) holds each K/V value clamped to
e4m3's largest finite magnitude, 448, and rounded to nearest: half the bytes of a 16-bit
cache, twice the tokens in the same memory, about 2 significant digits a value. The scale is
1: keys and values of the models here stay far below 448. Readers turn it back into the
model's dtype (exactly: every e4m3 value is a bf16, fp16 and fp32 value).
"""

from __future__ import annotations

import torch

__all__ = ["FP8_KV", "FP8_KV_MAX", "to_kv_cache"]

FP8_KV = torch.float8_e4m3fn
FP8_KV_MAX = torch.finfo(FP8_KV).max  # 448


def to_kv_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` holds it: itself, or for FP8 clamped and rounded."""
    if dtype != FP8_KV:
        return x
    return x.float().clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV)
