"""Rotary position embedding applied in place to q and k (HF rotate-half layout).

Each head vector of token t is split into halves (x1, x2) and rotated by the angles of
position p = positions[t]:

    x = [ x1 (d/2) | x2 (d/2) ]  ->  [ x1 cos[p] - x2 sin[p] | x2 cos[p] + x1 sin[p] ]

The tables come from ``RotaryEmbedding`` (models/rope.py), so any rope scaling (Llama-3,
linear) is already in them. The rotation runs in float32; the result is rounded once to the
input dtype.

Shapes:
    q:         [T, Hq, d]   strided view of the fused qkv output [T, Hq + 2 Hkv, d]
    k:         [T, Hkv, d]  idem
    positions: [T] int64, each < P
    cos, sin:  [P, d/2] float32

Kernel: one program per token rotates all its q heads and then all its k heads, each as one
[heads, d/2] tile per half.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.engine.models.rope import apply_rope

__all__ = ["rope_", "rope_ref"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rotate_heads(
    base_ptr,  # head 0, element 0 of one token
    num_heads,
    half,
    stride_h,
    cos,  # [1, BLOCK_HALF] float32
    sin,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (j < half)
    p1 = base_ptr + h * stride_h + j
    p2 = p1 + half
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    dtype = base_ptr.dtype.element_ty
    tl.store(p1, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    # pointers
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    # sizes
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
    # meta-parameters
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + j, mask=j < half, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + j, mask=j < half, other=0.0)[None, :]
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    _rotate_heads(
        q_ptr + t * stride_qt, num_q_heads, half, stride_qh, cos, sin, BLOCK_HQ, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr + t * stride_kt, num_kv_heads, half, stride_kh, cos, sin, BLOCK_HKV, BLOCK_HALF
    )


def _num_warps(block_hq: int, block_half: int) -> int:
    """~32 elements of the q tile a thread: 4 warps for Llama-3-8B's 32 heads of d 128.

    Measured on the H200 (BENCHMARKS.md): 4 warps beat 2, 8 and 16 at T = 4096 and 16384.
    """
    return max(1, min(16, block_hq * block_half * 2 // 1024))


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
) -> None:
    """Rotate q and k in place by the angles of ``positions``.

    Mutates q and k (and so the fused qkv tensor they view); reads the rest. q and k must
    not overlap. Positions must be < P: they are not checked on the device (that would need
    a host sync). Raises ValueError on shape, dtype, stride or device mismatches.
    """
    _check(q, k, positions, cos, sin)
    t, hq, d = q.shape
    hkv = k.shape[1]
    if t == 0:
        return
    block_hq, block_half = triton.next_power_of_2(hq), triton.next_power_of_2(d // 2)
    _rope_kernel[(t,)](
        q,
        k,
        positions,
        cos,
        sin,
        hq,
        hkv,
        d // 2,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        BLOCK_HQ=block_hq,
        BLOCK_HKV=triton.next_power_of_2(hkv),
        BLOCK_HALF=block_half,
        num_warps=_num_warps(block_hq, block_half),
    )


def rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's ``apply_rope`` run in float32; returns new rotated (q, k) in the input
    dtype and mutates nothing."""
    c = cos[positions].unsqueeze(1)  # [T, 1, d/2]
    s = sin[positions].unsqueeze(1)
    return (
        apply_rope(q.float(), c, s).to(q.dtype),
        apply_rope(k.float(), c, s).to(k.dtype),
    )
