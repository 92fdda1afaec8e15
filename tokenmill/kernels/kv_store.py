"""Write each token's K and V into the paged KV cache.

Token t goes to slot s = slot_mapping[t] of the layer's cache; a slot names a block and an
offset inside it. A negative slot marks a padding token (CUDA graphs pad the batch) and is
skipped.

    slot_mapping: [ 5, 6, 9, -1 ]            block_size BS = 4
    k_cache:      block 0     block 1     block 2
                  [ . . . . ] [ . 0 1 . ] [ . 2 . . ]     s -> (s // BS, s % BS)
                                                           token 3 is padding: not written

Shapes:
    k, v:          [T, Hkv, d]       any strides (views of the fused qkv output)
    k_cache, v_cache: [NB, BS, Hkv, d] any strides (the halves of the [2, NB, BS, Hkv, d] cache)
    slot_mapping:  [T] int64

Kernel: one program per token copies its [Hkv, d] tile of K and of V.

An FP8 cache (float8_e4m3fn) holds each value clamped to +-448 and rounded to e4m3, the
rounding of fp8_kv.py; the attention kernels turn it back into the model's dtype as they read.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8_kv import FP8_KV, to_kv_cache
from tokenmill.kernels.launch_log import launch

__all__ = ["store_kv", "store_kv_ref"]


@triton.jit
def _store_kv_kernel(
    # pointers
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    # sizes
    num_kv_heads,
    head_dim,
    block_size,
    # strides
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vco,
    stride_vch,
    stride_vcd,
    # meta-parameters
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TO_FP8: tl.constexpr,  # the cache is float8_e4m3fn: clamp to +-448, round
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # A padding token masks out every head. (Folded into the head bound: the interpreter
    # broadcasts a scalar bool into an int mask, which its loads reject.)
    heads = tl.where(slot >= 0, num_kv_heads, 0)
    slot = tl.maximum(slot, 0)  # keeps the (masked) addresses of padding tokens in range
    block = slot // block_size
    offset = slot % block_size

    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (h < heads) & (d < head_dim)

    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kco + h * stride_kch + d * stride_kcd
    vc = v_cache_ptr + block * stride_vcb + offset * stride_vco + h * stride_vch + d * stride_vcd
    if TO_FP8:
        k = tl.clamp(k.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv)
        v = tl.clamp(v.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv)
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


def _check(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"k and v must both be [T, Hkv, d]; got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, d]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(
            f"cache heads/head_dim {tuple(k_cache.shape[2:])} do not match k's {tuple(k.shape[1:])}"
        )
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 [T={k.shape[0]}]; got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    if not (k.dtype == v.dtype and k_cache.dtype == v_cache.dtype) or k_cache.dtype not in (
        k.dtype,
        FP8_KV,
    ):
        raise ValueError(
            f"dtypes differ: k {k.dtype}, v {v.dtype}, k_cache {k_cache.dtype}, "
            f"v_cache {v_cache.dtype}; the caches hold k/v's dtype or float8_e4m3fn"
        )
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def store_kv(
    k: torch.Tensor,  # [T, Hkv, d]
    v: torch.Tensor,  # [T, Hkv, d]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, d]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, d]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = skip
) -> None:
    """Copy k[t], v[t] into slot ``slot_mapping[t]`` of ``k_cache``, ``v_cache`` (in place).

    Mutates k_cache and v_cache only, and only at the slots named by non-negative entries of
    ``slot_mapping``; nothing else is written. Slots must be < NB * BS: they are not checked
    on the device (that would need a host sync). Raises ValueError on mismatched shapes,
    dtypes or devices.
    """
    _check(k, v, k_cache, v_cache, slot_mapping)
    t, n_kv, d = k.shape
    if t == 0:
        return
    if k_cache.dtype == FP8_KV and os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter's fp32 -> e4m3 conversion drops the carry of a mantissa that rounds
        # up to the next power of two (31.5 -> 16, not 32); there torch rounds beforehand.
        k, v = to_kv_cache(k, FP8_KV), to_kv_cache(v, FP8_KV)
    launch(
        _store_kv_kernel,
        (t,),
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        n_kv,
        d,
        k_cache.shape[1],
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_H=triton.next_power_of_2(n_kv),
        BLOCK_D=triton.next_power_of_2(d),
        TO_FP8=k.dtype != FP8_KV and k_cache.dtype == FP8_KV,
        num_warps=4,
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The torch backend's store (``index_copy_`` into the flattened cache), skipping slots
    < 0. Same arguments and mutations as :func:`store_kv`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    bs = k_cache.shape[1]
    # Advanced indexing by (block, offset) writes through any strides, where the backend's
    # view(-1, Hkv, d) needs a contiguous cache half.
    k_cache[slots // bs, slots % bs] = to_kv_cache(k[keep], k_cache.dtype)
    v_cache[slots // bs, slots % bs] = to_kv_cache(v[keep], v_cache.dtype)
