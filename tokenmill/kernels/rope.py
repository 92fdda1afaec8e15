"""Rotary position embedding applied in place to q and k (HF rotate-half layout).

Each head vector of token t is split into halves (x1, x2) and rotated by the angles of
position p = positions[t]:

    x = [ x1 (d/2) | x2 (d/2) ]  ->  [ x1 cos[p] - x2 sin[p] | x2 cos[p] + x1 sin[p] ]

The tables come from ``RotaryEmbedding`` (models/rope.py), so any rope scaling (Llama-3,
linear) is already in them. The rotation runs in float32, rounded where the engine's torch
path rounds (the tables, each product and each sum in the input dtype), so the Triton and
torch backends rotate to the same bits.

Shapes:
    q:         [T, Hq, d]   strided view of the fused qkv output [T, Hq + 2 Hkv, d]
    k:         [T, Hkv, d]  idem
    positions: [T] int64, each < P
    cos, sin:  [P, d/2] float32

Kernel: program i rotates TOKENS consecutive tokens, all their q heads and all their k heads,
as one [TOKENS, heads, d/2] tile per half; tokens past T are masked off:

    T = 7, TOKENS = 4:   tokens  0 1 2 3 | 4 5 6 (7)
                         program    0    |    1     (7) masked: no load, no store

Every q and k load of the tile is issued before the positions -> cos/sin loads and before any
store, so one program keeps all its bytes in flight and waits on memory about twice (loads,
then the dependent table rows) however many tokens it holds. ``_launch_config`` picks TOKENS
and num_warps.

With ``kv`` the same program also stores the token's rotated k and its v into the paged KV
cache at its slot (what kv_store.py's kernel would do next, to the same bits, FP8 cache
included): the attention backend then launches no store of its own (``rope_kv_slots``), one
kernel fewer a layer, and k and v are read once. On an H100, SmolLM2's decode step at 1,024
rows took 1.5% less GPU time; at 256 rows nothing measurable (BENCHMARKS session 43).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8_kv import FP8_KV
from tokenmill.kernels.kv_store import store_kv
from tokenmill.kernels.launch_log import launch
from tokenmill.kernels.rotate_half import apply_rope

__all__ = ["rope_", "rope_ref"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ELEMENTS_PER_THREAD = 32  # fp32 q + k tile elements a thread (warps round down)


@triton.jit
def _load_heads(
    base_ptr,  # head 0, element 0 of token 0
    tok,  # [TOKENS, 1, 1] int64 token ids
    num_tokens,
    num_heads,
    half,
    stride_t,
    stride_h,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_HEADS)[None, :, None]
    j = tl.arange(0, BLOCK_HALF)[None, None, :]
    mask = (tok < num_tokens) & (h < num_heads) & (j < half)  # [TOKENS, BLOCK_HEADS, BLOCK_HALF]
    p1 = base_ptr + tok * stride_t + h * stride_h + j
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + half, mask=mask, other=0.0)
    return p1, mask, x1, x2


@triton.jit
def _store_rotated(
    p1,  # [TOKENS, BLOCK_HEADS, BLOCK_HALF] pointers to x1; x2 lies half further
    mask,
    x1,
    x2,
    half,
    cos,  # [TOKENS, 1, BLOCK_HALF] float32
    sin,
):
    # Rounded where the engine's torch path rounds (tables, each product, the sum, in x's
    # dtype), so both backends rotate to the same bits; in fp32 every rounding is a no-op.
    # The launch turns FMA contraction off: otherwise the compiler turns a product and the
    # sum into one 16-bit FMA, one rounding where torch has two (24% of bf16 outputs off).
    dtype = p1.dtype.element_ty
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    a = (x1 * cos).to(dtype).to(tl.float32)
    b = (x2 * sin).to(dtype).to(tl.float32)
    r1 = (a - b).to(dtype)
    tl.store(p1, r1, mask=mask)
    a = (x2 * cos).to(dtype).to(tl.float32)
    b = (x1 * sin).to(dtype).to(tl.float32)
    r2 = (a + b).to(dtype)
    tl.store(p1 + half, r2, mask=mask)
    return r1, r2


@triton.jit
def _store_in_cache(
    cache_ptr,
    slot,  # [TOKENS, 1, 1] int64, < 0: not stored
    mask,  # [TOKENS, BLOCK_HEADS, BLOCK_HALF] the tile's own
    x1,
    x2,
    half,
    block_size,
    stride_b,
    stride_o,
    stride_h,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    TO_FP8: tl.constexpr,
):
    # As kv_store.py's kernel stores (the same conversion, so the same cache bits).
    h = tl.arange(0, BLOCK_HEADS)[None, :, None]
    j = tl.arange(0, BLOCK_HALF)[None, None, :]
    at = tl.maximum(slot, 0)
    p1 = cache_ptr + (at // block_size) * stride_b + (at % block_size) * stride_o + h * stride_h + j
    mask = mask & (slot >= 0)
    if TO_FP8:
        x1 = tl.clamp(x1.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv)
        x2 = tl.clamp(x2.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv)
    tl.store(p1, x1, mask=mask)
    tl.store(p1 + half, x2, mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _rope_kernel(
    # pointers
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    # sizes
    num_tokens,
    num_q_heads,
    num_kv_heads,
    half,
    # strides (the last dims are contiguous)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    # the KV store (STORE_KV): v, the caches [NB, BS, Hkv, d] and each token's slot
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    block_size,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    # meta-parameters
    TOKENS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    STORE_KV: tl.constexpr,
    TO_FP8: tl.constexpr,  # the cache is float8_e4m3fn
):
    tok = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)  # [TOKENS]
    tok3 = tok[:, None, None]  # [TOKENS, 1, 1]
    q_p, q_mask, q1, q2 = _load_heads(
        q_ptr, tok3, num_tokens, num_q_heads, half, stride_qt, stride_qh, BLOCK_HQ, BLOCK_HALF
    )
    k_p, k_mask, k1, k2 = _load_heads(
        k_ptr, tok3, num_tokens, num_kv_heads, half, stride_kt, stride_kh, BLOCK_HKV, BLOCK_HALF
    )
    # Masked tokens read row 0 of the tables; their results are never stored.
    pos = tl.load(pos_ptr + tok, mask=tok < num_tokens, other=0).to(tl.int64)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    cs_mask = (tok[:, None] < num_tokens) & (j < half)  # [TOKENS, BLOCK_HALF]
    # Loaded 2-D and then expanded, so the compiler lays the rows out as a slice of the q/k
    # tiles' layout; a 3-D [TOKENS, 1, BLOCK_HALF] load becomes a layout of its own, and at
    # 8 tokens / 16 warps the tiles were shuffled through shared memory to match it.
    cos = tl.load(cos_ptr + pos * stride_cos + j, mask=cs_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + j, mask=cs_mask, other=0.0).to(tl.float32)
    cos = cos[:, None, :]  # [TOKENS, 1, BLOCK_HALF]
    sin = sin[:, None, :]
    _store_rotated(q_p, q_mask, q1, q2, half, cos, sin)
    k1, k2 = _store_rotated(k_p, k_mask, k1, k2, half, cos, sin)
    if STORE_KV:
        slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
        slot = slot[:, None, None]  # [TOKENS, 1, 1]
        _, v_mask, v1, v2 = _load_heads(
            v_ptr, tok3, num_tokens, num_kv_heads, half, stride_vt, stride_vh, BLOCK_HKV,
            BLOCK_HALF,
        )  # fmt: skip
        _store_in_cache(k_cache_ptr, slot, k_mask, k1, k2, half, block_size, stride_kcb,
                        stride_kco, stride_kch, BLOCK_HKV, BLOCK_HALF, TO_FP8)  # fmt: skip
        _store_in_cache(v_cache_ptr, slot, v_mask, v1, v2, half, block_size, stride_vcb,
                        stride_vco, stride_vch, BLOCK_HKV, BLOCK_HALF, TO_FP8)  # fmt: skip


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _launch_config(hq: int, hkv: int, d: int) -> tuple[int, int]:
    """(TOKENS, num_warps) for hq q and hkv k heads of size d, whatever the token count.

    One token a program, num_warps giving a thread about 32 elements of the padded q + k
    tile (4 warps for a Llama-3-8B token: 32 + 8 heads of d 128). Measured on the H200
    (bench/kernel_bench_elementwise.py --sweep, BENCHMARKS.md), Llama-3-8B bf16, with FMA
    contraction off: one token / 4 warps reached 74% of the copy ceiling at T = 4,096 and
    92% at 16,384 (8 warps: 69% and 84%; 2 warps: 76% and 89%); packing 2, 4 or 8 tokens a
    program was no faster at either size.
    """
    half = triton.next_power_of_2(d // 2)
    per_token = (triton.next_power_of_2(hq) + triton.next_power_of_2(hkv)) * 2 * half
    return 1, max(1, min(16, _pow2_floor(per_token // (32 * _ELEMENTS_PER_THREAD))))


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q must be [T, Hq, d] and k [T, Hkv, d]; got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    d = q.shape[2]
    if d % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE; got {d}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        raise ValueError(
            f"q, k dtypes must match and be one of {_DTYPES}; got {q.dtype}, {k.dtype}"
        )
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(
            f"q and k must be contiguous in head_dim; strides {q.stride()}, {k.stride()}"
        )
    if positions.shape != (q.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be int64 [T={q.shape[0]}]; got {positions.dtype} "
            f"{tuple(positions.shape)}"
        )
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != d // 2 or table.dtype != torch.float32:
            raise ValueError(
                f"{name} must be float32 [P, d/2={d // 2}]; got {table.dtype} {tuple(table.shape)}"
            )
        if table.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; strides {table.stride()}")
    devices = {t.device for t in (q, k, positions, cos, sin)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def rope_(
    q: torch.Tensor,  # [T, Hq, d]
    k: torch.Tensor,  # [T, Hkv, d]
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, d/2] float32
    sin: torch.Tensor,  # [P, d/2] float32
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Rotate q and k in place by the angles of ``positions``; with ``kv`` = (v [T, Hkv, d],
    kv_cache [2, num_blocks, block_size, Hkv, d], slot_mapping [T] int64), also store the
    rotated k and v into the cache at each token's slot (< 0: not stored), as
    ``store_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping)`` after it would, to the same bits.

    Mutates q and k (and so the fused qkv tensor they view), and the cache at the slots;
    reads the rest. q and k must not overlap. Positions must be < P and slots inside the
    cache: they are not checked on the device (that would need a host sync). Raises
    ValueError on shape, dtype, stride or device mismatches.
    """
    _check(q, k, positions, cos, sin)
    t, hq, d = q.shape
    hkv = k.shape[1]
    if kv is not None and kv[1].dtype == FP8_KV and os.environ.get("TRITON_INTERPRET") == "1":
        # the interpreter's e4m3 conversion is store_kv's to work around (kv_store.py)
        rope_(q, k, positions, cos, sin)
        store_kv(k, kv[0], kv[1][0], kv[1][1], kv[2])
        return
    if kv is not None:
        _check_kv(k, *kv)
    if t == 0:
        return
    if kv is None:  # no store: its arguments are never read (STORE_KV off)
        v, k_cache, v_cache, slots, block_size = k, q, q, positions, 1
        kc = vc = (0, 0, 0)
    else:
        v, cache, slots = kv
        k_cache, v_cache, block_size = cache[0], cache[1], cache.shape[2]
        kc, vc = k_cache.stride()[:3], v_cache.stride()[:3]
    tokens, num_warps = _launch_config(hq, hkv, d)
    launch(
        _rope_kernel, (triton.cdiv(t, tokens),),
        q, k, positions, cos, sin,
        t, hq, hkv, d // 2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        v, k_cache, v_cache, slots, block_size,
        v.stride(0), v.stride(1), *kc, *vc,
        TOKENS=tokens,
        BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HKV=triton.next_power_of_2(hkv),
        BLOCK_HALF=triton.next_power_of_2(d // 2),
        STORE_KV=kv is not None,
        TO_FP8=kv is not None and k_cache.dtype == FP8_KV and k.dtype != FP8_KV,
        num_warps=num_warps,
        enable_fp_fusion=False,  # see _store_rotated
    )  # fmt: skip


def _check_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if v.shape != k.shape or v.dtype != k.dtype or v.stride(2) != 1:
        raise ValueError(
            f"v must be {k.dtype} {tuple(k.shape)} contiguous in head_dim; got {v.dtype} "
            f"{tuple(v.shape)} strides {v.stride()}"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != k.shape[1:]:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {k.shape[1]}, {k.shape[2]}]; got "
            f"{tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in (k.dtype, FP8_KV) or kv_cache.stride(4) != 1:
        raise ValueError(
            f"kv_cache must be {k.dtype} or {FP8_KV}, contiguous in head_dim; got "
            f"{kv_cache.dtype} strides {kv_cache.stride()}"
        )
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 [T={k.shape[0]}]; got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    devices = {x.device for x in (k, v, kv_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's torch path (``apply_rope`` with the tables cast to q's dtype); returns
    new rotated (q, k) and mutates nothing."""
    c = cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, d/2]
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return apply_rope(q, c, s), apply_rope(k, c, s)
