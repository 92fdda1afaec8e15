"""Input checks shared by the paged attention wrappers (prefill and decode).

Both take queries against one layer's paged cache:

    q             [tokens or B, Hq, d]
    k/v_cache     [num_blocks, block_size, Hkv, d]   views of the engine's [2, ...] cache
    block_tables  [B, max_blocks] int32              cache block of each block_size keys
    per-request   [B] / [B + 1] int32                seq_lens, query_start_loc

and raise ValueError naming the kernel, the argument, what was expected and what came.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["HEAD_DIMS", "PagedShapes", "check_paged_inputs", "takes_head_dim"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = "powers of two from 16 to 256"


def takes_head_dim(d: int) -> bool:
    """Whether the paged attention kernels take head dim ``d`` (``HEAD_DIMS``)."""
    return 16 <= d <= 256 and not d & (d - 1)


@dataclass(frozen=True)
class PagedShapes:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


def check_paged_inputs(
    kernel: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_requests: int,
    per_request: dict[str, tuple[torch.Tensor, tuple[int, ...]]],
) -> PagedShapes:
    """Checks q against the caches (ranks, head dim, GQA ratio, dtypes), block_tables
    ([num_requests, max_blocks] int32, contiguous rows) and each ``per_request`` int32 tensor
    against its expected shape, and that everything sits on one device that Triton can run
    on. Returns the head counts, head dim and block size."""

    def fail(msg: str) -> None:
        raise ValueError(f"{kernel}: {msg}")

    if q.dim() != 3:
        fail(f"q must be [tokens, Hq, d], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        fail(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, d], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    hq, d = q.shape[1], q.shape[2]
    _, block_size, hkv, kv_dim = k_cache.shape
    if kv_dim != d:
        fail(f"head dim: q has {d}, k_cache/v_cache have {kv_dim}")
    if not takes_head_dim(d):
        fail(f"head dim {d}: supported are {HEAD_DIMS}")
    if hq % hkv:
        fail(f"Hq={hq} query heads is not a multiple of Hkv={hkv} KV heads")
    cache_ok = k_cache.dtype in (q.dtype, torch.float8_e4m3fn) and v_cache.dtype == k_cache.dtype
    if q.dtype not in DTYPES or not cache_ok:
        fail(
            f"dtypes: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}; "
            "expected q one of float16/bfloat16/float32 and both caches q's dtype or "
            "float8_e4m3fn (an FP8 KV cache)"
        )
    table_ok = block_tables.dim() == 2 and block_tables.shape[0] == num_requests
    if block_tables.dtype != torch.int32 or not table_ok:
        fail(
            f"block_tables: expected int32 [B={num_requests}, max_blocks], got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if block_tables.stride(-1) != 1:
        fail(f"block_tables: need contiguous rows, got strides {block_tables.stride()}")
    for name, (x, shape) in per_request.items():
        if x.dtype != torch.int32 or tuple(x.shape) != shape:
            fail(f"{name}: expected int32 {shape}, got {x.dtype} {tuple(x.shape)}")
    others = {"k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    others.update({name: x for name, (x, _) in per_request.items()})
    for name, x in others.items():
        if x.device != q.device:
            fail(f"{name} is on {x.device}, q on {q.device}: move them to one device")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        fail(
            f"q is on {q.device}: the Triton kernel needs CUDA tensors "
            "(or TRITON_INTERPRET=1 set before tokenmill.kernels is imported)"
        )
    return PagedShapes(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=block_size)
