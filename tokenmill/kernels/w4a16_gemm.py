"""W4A16 GEMM: 16-bit activations times 4-bit group-quantized weights, dequantized in
registers, and its reference.

Weights ("q4 rows", the layout GGUF's Q4_0 / Q4_1 blocks already use): N output rows of K
inputs, 4-bit codes q in 0..15, and per group of GROUP consecutive inputs a scale and a min:

    w[n, k] = scales[n, k // GROUP] * q[n, k] + mins[n, k // GROUP]

    qweight [N, K / 2] uint8   inputs in chunks of 32: byte 16c + i of a row holds input
                               32c + i in its low nibble and input 32c + i + 16 in its high
    scales  [N, K / GROUP]     float16 (or any float)
    mins    [N, K / GROUP]     float16 (GGUF Q4_0 and zero-point formats: -scale * zero)

    chunk c of a row:  bytes [ b0 b1 ... b15 ]  ->  inputs [ lo(b0) .. lo(b15) | hi(b0) .. hi(b15) ]
                                                          32c ....... 32c+15    32c+16 .... 32c+31

K must be a multiple of 32 and GROUP a multiple of 32. A weight takes 4 bits plus 32 bits of
scale and min per GROUP inputs: 5 bits at GROUP 32 (GGUF), 4.25 at 128 (GPTQ, AWQ).

Kernel: grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), split_k), tiles from int_weight_tiles.py.
A program loads BLOCK_K / 2 bytes of each of its BLOCK_N weight rows at a time (BLOCK_K
inputs), splits the nibbles, scales them by their groups and accumulates two
[BLOCK_M, BLOCK_K/2] @ [BLOCK_K/2, BLOCK_N] dots in fp32 (the low nibbles against x at
32c + i, the high ones at 32c + 16 + i). Reading 4-bit weights is what decode (small M)
should be bound by; on the H200 it is not yet (BENCHMARKS.md, session 13).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.int_weight_tiles import IntGemmTiles, choose_tiles, store_tile, tile_dot

__all__ = ["check_q4_weight", "dequantize_q4", "pack_q4", "w4a16_linear", "w4a16_linear_ref"]

CHUNK = 32  # inputs per packed chunk: 16 bytes, two nibbles each


@triton.jit
def _nibbles(q_rows, k0, mask_n, BLOCK_K: tl.constexpr):
    """The low and high nibbles of the BLOCK_K / 2 bytes of each row from input k0 on, as
    fp32 [BLOCK_N, BLOCK_K / 2]: byte j's nibbles are inputs k0 + 32(j // 16) + j % 16 and
    that + 16."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    # k0 is a multiple of BLOCK_K (K runs are whole tiles), which the compiler cannot see
    # through a runtime SPLIT_K: told so, it loads 16 bytes at a time instead of one.
    offs_b = tl.max_contiguous(tl.multiple_of(offs_b, BLOCK_K // 2), BLOCK_K // 2)
    b = tl.load(q_rows + offs_b[None, :], mask=mask_n[:, None], other=0)  # [BN, BK/2]
    return (b & 0xF).to(tl.float32), (b >> 4).to(tl.float32)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr,
    M, N, K, SPLIT_K,  # SPLIT_K: runs of K (divides K / BLOCK_K)
    stride_xm, stride_xk, stride_qn, stride_sn, stride_mn, stride_ym, stride_yn,
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
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_j = tl.arange(0, BLOCK_K // 2)
    x_lo_k = (offs_j // 16) * 32 + offs_j % 16  # input of byte j's low nibble, from k0
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    q_rows = qw_ptr + offs_n[:, None].to(tl.int64) * stride_qn
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn
    m_rows = m_ptr + offs_n[:, None].to(tl.int64) * stride_mn
    k_run = K // SPLIT_K
    k_first = tl.program_id(2) * k_run
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_first, k_first + k_run, BLOCK_K):
        lo, hi = _nibbles(q_rows, k0, mask_n, BLOCK_K)  # [BN, BK/2] codes
        if BLOCK_K >= GROUP:  # the tile holds BLOCK_K // GROUP whole groups
            offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            offs_g = tl.max_contiguous(tl.multiple_of(offs_g, BLOCK_K // GROUP), BLOCK_K // GROUP)
            s = tl.load(s_rows + offs_g[None, :], mask=mask_n[:, None], other=0.0)
            mn = tl.load(m_rows + offs_g[None, :], mask=mask_n[:, None], other=0.0)
            s = s.to(tl.float32)[:, :, None]  # [BN, groups, 1]
            mn = mn.to(tl.float32)[:, :, None]
            lo = tl.reshape(lo, [BLOCK_N, BLOCK_K // GROUP, GROUP // 2]) * s + mn
            hi = tl.reshape(hi, [BLOCK_N, BLOCK_K // GROUP, GROUP // 2]) * s + mn
            w_lo = tl.reshape(lo, [BLOCK_N, BLOCK_K // 2])
            w_hi = tl.reshape(hi, [BLOCK_N, BLOCK_K // 2])
        else:  # the tile sits inside one group
            g = k0 // GROUP
            s = tl.load(s_rows + g, mask=mask_n[:, None], other=0.0).to(tl.float32)
            mn = tl.load(m_rows + g, mask=mask_n[:, None], other=0.0).to(tl.float32)
            w_lo = lo * s + mn
            w_hi = hi * s + mn
        offs_x = tl.max_contiguous(tl.multiple_of(k0 + x_lo_k, 16), 16)  # runs of 16 inputs
        x_lo = tl.load(x_rows + offs_x[None, :] * stride_xk, mask=mask_m[:, None], other=0.0)
        x_hi = tl.load(x_rows + (offs_x + 16)[None, :] * stride_xk, mask=mask_m[:, None], other=0.0)
        acc = tile_dot(acc, x_lo, w_lo, MMA, DOT_FP32)
        acc = tile_dot(acc, x_hi, w_hi, MMA, DOT_FP32)
    store_tile(y_ptr, acc, offs_m, offs_n, M, N, stride_ym, stride_yn, PARTIAL)


def check_q4_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    caller: str,
    k: int | None = None,
) -> tuple[int, int, int]:
    """(N, K, GROUP) of a q4-rows weight (the module docstring's layout) after checking its
    three tensors; ``k``, when the caller's activations fix it, must be qweight's. Raises
    ValueError naming ``caller``."""

    def fail(msg: str) -> None:
        raise ValueError(f"{caller}: {msg}")

    if qweight.dim() != 2 or qweight.dtype != torch.uint8:
        fail(f"qweight must be uint8 [N, K/2], got {qweight.dtype} {tuple(qweight.shape)}")
    n = qweight.shape[0]
    k = qweight.shape[1] * 2 if k is None else k
    if k % CHUNK or qweight.shape[1] * 2 != k:
        fail(f"K={k} must be a multiple of {CHUNK} and qweight's width K/2 ({qweight.shape[1]})")
    groups = scales.shape[1] if scales.dim() == 2 else 0
    if scales.shape != mins.shape or scales.shape[0] != n or not groups or k % groups:
        fail(f"scales and mins must be [N={n}, K/GROUP], got {tuple(scales.shape)} and "
             f"{tuple(mins.shape)}")  # fmt: skip
    group = k // groups
    if group % CHUNK:
        fail(f"the group size K / groups = {group} must be a multiple of {CHUNK}")
    return n, k, group


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
    if x.dim() != 2:
        raise ValueError(f"w4a16_linear: x must be [M, K], got {tuple(x.shape)}")
    return check_q4_weight(qweight, scales, mins, "w4a16_linear", x.shape[1])


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    *,
    tiles: IntGemmTiles | None = None,
) -> torch.Tensor:
    """``x`` [M, K] @ dequantized(qweight, scales, mins)^T -> [M, N] in x's dtype (see the
    module docstring for the layout). ``tiles``: the launch's tiling (default
    ``choose_tiles``), fitted to K and the group. Raises ValueError on bad shapes."""
    n, k, group = _check(x, qweight, scales, mins)
    m = x.shape[0]
    if m == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    t = tiles.fit(k, group) if tiles else choose_tiles(m, n, k, group, code_bits=4)
    s, mn = scales.contiguous(), mins.contiguous()
    qw = qweight.contiguous()
    y = t.output(m, n, x.dtype, x.device)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), t.split_k)
    _w4a16_kernel[grid](
        x, qw, s, mn, y, m, n, k, t.split_k,
        x.stride(0), x.stride(1), qw.stride(0), s.stride(0), mn.stride(0),
        y.stride(-2), y.stride(-1),
        GROUP=group, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        PARTIAL=t.split_k > 1, MMA=t.mma,
        DOT_FP32=x.dtype == torch.float32 or x.device.type == "cpu",
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return t.finish(y, x.dtype)


def dequantize_q4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K] that the packed ones stand for."""
    n, half = qweight.shape
    chunks = qweight.reshape(n, half // 16, 16)
    q = torch.cat([chunks & 0xF, chunks >> 4], dim=2)  # [N, K / 32, 32] codes, input order
    groups = scales.shape[1]
    q = q.reshape(n, groups, -1).float()  # [N, groups, GROUP]
    w = q * scales.float()[:, :, None] + mins.float()[:, :, None]
    return w.reshape(n, half * 2)


def pack_q4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (values 0..15) -> qweight [N, K/2] uint8 in the q4-rows layout."""
    n, k = codes.shape
    c = codes.reshape(n, k // CHUNK, CHUNK).to(torch.uint8)
    return (c[:, :, :16] | (c[:, :, 16:] << 4)).reshape(n, k // 2)


def w4a16_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """Plain torch: dequantize to float32, multiply, round to x's dtype."""
    _check(x, qweight, scales, mins)
    return (x.float() @ dequantize_q4(qweight, scales, mins).t()).to(x.dtype)
