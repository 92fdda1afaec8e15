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

Kernel: grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), split_k), tiles from int_weight_tiles.py.
A program loads BLOCK_K codes of each of its BLOCK_N weight rows at a time, scales them by
their groups and accumulates [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N] in fp32. Like W4A16,
it should pay where reading the weights bounds the GEMM (decode, small M); on the H200 it
does not yet (BENCHMARKS.md, session 13).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.int_weight_tiles import IntGemmTiles, choose_tiles, store_tile, tile_dot

__all__ = ["check_q8_weight", "dequantize_q8", "scale_q8_tile", "w8a16_linear", "w8a16_linear_ref"]

CHUNK = 32  # the group size must be a multiple of this (GGUF's block)


@triton.jit
def scale_q8_tile(
    q, s_rows, k0, mask_rows, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """fp32 weights of a [BLOCK_N, BLOCK_K] tile of int8 codes ``q`` from input ``k0`` on:
    each code times its group's scale (``s_rows``: [BLOCK_N, 1] pointers to each row's
    scales; rows off ``mask_rows`` read 0). BLOCK_K is a multiple or a divisor of GROUP."""
    q = q.to(tl.float32)
    if BLOCK_K >= GROUP:  # the tile holds BLOCK_K // GROUP whole groups
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        offs_g = tl.max_contiguous(tl.multiple_of(offs_g, BLOCK_K // GROUP), BLOCK_K // GROUP)
        s = tl.load(s_rows + offs_g[None, :], mask=mask_rows, other=0.0)
        s = s.to(tl.float32)[:, :, None]  # [BN, groups, 1]
        w = tl.reshape(tl.reshape(q, [BLOCK_N, BLOCK_K // GROUP, GROUP]) * s,
                       [BLOCK_N, BLOCK_K])  # fmt: skip
    else:  # the tile sits inside one group
        s = tl.load(s_rows + k0 // GROUP, mask=mask_rows, other=0.0)
        w = q * s.to(tl.float32)
    return w


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _w8a16_kernel(
    x_ptr, qw_ptr, s_ptr, y_ptr,
    M, N, K, SPLIT_K,  # SPLIT_K: runs of K (divides K / BLOCK_K)
    stride_xm, stride_xk, stride_qn, stride_sn, stride_ym, stride_yn,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides K; a multiple or a divisor of GROUP
    PARTIAL: tl.constexpr,  # SPLIT_K > 1: y is fp32 [SPLIT_K, M, N], a K run's sum each
    MMA: tl.constexpr,  # tensor-core dots; False: multiply and sum on CUDA cores (tiny M)
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
    k_run = K // SPLIT_K
    k_first = tl.program_id(2) * k_run
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_first, k_first + k_run, BLOCK_K):
        # k0 is a multiple of BLOCK_K (K runs are whole tiles), which the compiler cannot see
        # through a runtime SPLIT_K: told so, it loads 16 bytes at a time instead of one.
        offs = tl.max_contiguous(tl.multiple_of(k0 + offs_k, BLOCK_K), BLOCK_K)
        q = tl.load(q_rows + offs[None, :], mask=mask_n[:, None], other=0)
        w = scale_q8_tile(q, s_rows, k0, mask_n[:, None], GROUP, BLOCK_N, BLOCK_K)
        x = tl.load(x_rows + offs[None, :] * stride_xk, mask=mask_m[:, None], other=0.0)
        acc = tile_dot(acc, x, w, MMA, DOT_FP32)
    store_tile(y_ptr, acc, offs_m, offs_n, M, N, stride_ym, stride_yn, PARTIAL)


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
    tiles: IntGemmTiles | None = None,
) -> torch.Tensor:
    """``x`` [M, K] @ dequantized(qweight, scales)^T -> [M, N] in x's dtype (see the module
    docstring for the layout). ``tiles``: the launch's tiling (default ``choose_tiles``),
    fitted to K and the group. Raises ValueError on bad shapes."""
    if x.dim() != 2:
        raise ValueError(f"w8a16_linear: x must be [M, K], got {tuple(x.shape)}")
    n, k, group = check_q8_weight(qweight, scales, "w8a16_linear", x.shape[1])
    m = x.shape[0]
    if m == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    t = tiles.fit(k, group) if tiles else choose_tiles(m, n, k, group)
    qw, s = qweight.contiguous(), scales.contiguous()
    y = t.output(m, n, x.dtype, x.device)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), t.split_k)
    _w8a16_kernel[grid](
        x, qw, s, y, m, n, k, t.split_k,
        x.stride(0), x.stride(1), qw.stride(0), s.stride(0), y.stride(-2), y.stride(-1),
        GROUP=group, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        PARTIAL=t.split_k > 1, MMA=t.mma,
        DOT_FP32=x.dtype == torch.float32 or x.device.type == "cpu",
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return t.finish(y, x.dtype)


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
