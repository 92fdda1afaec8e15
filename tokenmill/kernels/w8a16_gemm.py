"""W8A16 GEMM: 16-bit activations times 8-bit group-quantized weights, dequantized in
registers, and its reference.

Weights ("q8 rows", GGUF Q8_0's layout with the blocks' scales moved beside the codes): N
output rows of K inputs, signed 8-bit codes q, and per group of GROUP consecutive inputs a
scale:

    w[n, k] = scales[n, k // GROUP] * q[n, k]

    qweight [N, K]          int8
    scales  [N, K / GROUP]  float16 (or any float)

K must be a multiple of GROUP, and GROUP of 32. A weight takes 8 bits plus 16 bits of scale
per GROUP inputs: 8.5 bits at GROUP 32 (GGUF Q8_0), about half of bf16's bytes.

Kernel: grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); each program walks K in steps of
BLOCK_K, loads [BLOCK_N, BLOCK_K] codes and the scales of their groups, dequantizes them into
x's dtype and accumulates [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N] in fp32. Like W4A16, it
pays where reading the weights bounds the GEMM (decode, small M).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["check_q8_weight", "dequantize_q8", "w8a16_linear", "w8a16_linear_ref"]

CHUNK = 32  # the group size must be a multiple of this (GGUF's block)


@triton.jit
def _w8a16_kernel(
    x_ptr, qw_ptr, s_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qn, stride_sn, stride_ym, stride_yn,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 inputs, or the interpreter (its bf16 dots are wrong)
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    q_rows = qw_ptr + offs_n[:, None].to(tl.int64) * stride_qn
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        x = tl.load(
            x_rows + k[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        wmask = mask_n[:, None] & mask_k[None, :]
        q = tl.load(q_rows + k[None, :], mask=wmask, other=0)
        s = tl.load(s_rows + (k // GROUP)[None, :], mask=wmask, other=0.0)
        w = q.to(tl.float32) * s.to(tl.float32)  # [BLOCK_N, BLOCK_K]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def check_q8_weight(
    qweight: torch.Tensor, scales: torch.Tensor, caller: str, k: int | None = None
) -> tuple[int, int, int]:
    """(N, K, GROUP) of a q8-rows weight (the module docstring's layout) after checking its
    two tensors; ``k``, when the caller's activations fix it, must be qweight's. Raises
    ValueError naming ``caller``."""
    if qweight.dim() != 2 or qweight.dtype != torch.int8:
        raise ValueError(
            f"{caller}: qweight must be int8 [N, K], got {qweight.dtype} {tuple(qweight.shape)}"
        )
    n, width = qweight.shape
    k = width if k is None else k
    groups = scales.shape[1] if scales.dim() == 2 else 0
    if width != k or scales.shape[0] != n or not groups or k % groups or (k // groups) % CHUNK:
        raise ValueError(
            f"{caller}: qweight [N, K] = {tuple(qweight.shape)} (K={k} expected) needs scales "
            f"[N, K / GROUP] with GROUP a multiple of {CHUNK}, got {tuple(scales.shape)}"
        )
    return n, k, k // groups


def w8a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    *,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """``x`` [M, K] @ dequantized(qweight, scales)^T -> [M, N] in x's dtype (see the module
    docstring for the layout). Raises ValueError on bad shapes."""
    if x.dim() != 2:
        raise ValueError(f"w8a16_linear: x must be [M, K], got {tuple(x.shape)}")
    n, k, group = check_q8_weight(qweight, scales, "w8a16_linear", x.shape[1])
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    qw, s = qweight.contiguous(), scales.contiguous()
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a16_kernel[grid](
        x, qw, s, y, m, n, k,
        x.stride(0), x.stride(1), qw.stride(0), s.stride(0), y.stride(0), y.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=x.dtype == torch.float32 or x.device.type == "cpu",
    )  # fmt: skip
    return y


def dequantize_q8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K] that the codes and scales stand for."""
    n, k = qweight.shape
    groups = scales.shape[1]
    w = qweight.reshape(n, groups, k // groups).float() * scales.float()[:, :, None]
    return w.reshape(n, k)


def w8a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Plain torch: dequantize to float32, multiply, round to x's dtype."""
    check_q8_weight(qweight, scales, "w8a16_linear_ref", x.shape[-1])
    return (x.float() @ dequantize_q8(qweight, scales).t()).to(x.dtype)
