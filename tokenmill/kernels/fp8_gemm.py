"""FP8 W8A8 GEMM for decode-sized batches: e4m3 activations and weights, one fp32 scale per
activation row and per weight row, and its reference.

    x_q      [M, K]  e4m3fn   (fp8_quant.py's rows)     x_scale [M, 1] fp32
    w_q      [N, K]  e4m3fn   (the FP8 layer's weight)   w_scale [1, N] fp32
    y[m, n] = x_scale[m] * w_scale[n] * sum_k x_q[m, k] * w_q[n, k]      -> [M, N] out_dtype

The layer runs ``torch._scaled_mm`` (cuBLAS). At M = 16 that was slower than bf16 on the
H200; this kernel, fed by 16-byte pipelined loads (offsets the compiler can see aligned,
``tl.multiple_of``), beat it there on qkv (session 15: 0.0135 ms against 0.0212). At
M = 256 cuBLAS is faster (an FP8 GEMM there is compute-bound: gate_up ran at ~1,080
TFLOP/s). bench/fp8_gemm.py timed every Llama-3-8B shape (session 16): this kernel won all
four at M = 16 and 64, so the FP8 layer (engine/models/fp8.py) takes it up to 64 rows and
``_scaled_mm`` beyond. Split-K (``tiles.split_k``) is there for tilings
that want it; the default has none.

Kernel: grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), split_k), tiles from int_weight_tiles.py
(their split-K partials and fixed-order sum too). Each program runs one K run, BLOCK_K at a
time: a [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N] e4m3 dot (both operands K-major, as Hopper's
FP8 tensor cores take them) into fp32, then scales its tile by the rows' and columns' scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8_rows import FP8
from tokenmill.kernels.int_weight_tiles import IntGemmTiles, store_tile

__all__ = ["choose_fp8_tiles", "fp8_gemm", "fp8_gemm_ref"]


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr,
    M, N, K, SPLIT_K,  # SPLIT_K: runs of K (divides K / BLOCK_K)
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides K
    PARTIAL: tl.constexpr,  # SPLIT_K > 1: y is fp32 [SPLIT_K, M, N], a K run's sum each
    DOT_FP32: tl.constexpr,  # the interpreter: dots of the values widened to fp32
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    k_run = K // SPLIT_K
    k_first = tl.program_id(2) * k_run
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_first, k_first + k_run, BLOCK_K):
        # K runs start at whole tiles: said so, the compiler loads 16 bytes at a time
        offs = tl.max_contiguous(tl.multiple_of(k0 + offs_k, BLOCK_K), BLOCK_K)
        x = tl.load(x_rows + offs[None, :], mask=mask_m[:, None], other=0.0)  # [BM, BK]
        w = tl.load(w_rows + offs[None, :], mask=mask_n[:, None], other=0.0)  # [BN, BK]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    x_scale = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
    w_scale = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    acc = acc * x_scale[:, None] * w_scale[None, :]
    store_tile(y_ptr, acc, offs_m, offs_n, M, N, stride_ym, 1, PARTIAL)


def choose_fp8_tiles(m: int, n: int, k: int) -> IntGemmTiles:
    """Default tiles: 64-row tiles (the smallest Hopper FP8 tensor-core tile), 64 columns,
    K in runs of 256 up to 64 rows and 128 beyond, no split-K. The H200 sweep of session 15
    found these fastest for qkv at M = 16 (0.0135 ms against 0.0193 for 128 columns split
    four ways) and for qkv, o and gate_up at M = 256 (block_k 128)."""
    block_k = 256 if m <= 64 else 128
    return IntGemmTiles(64, 64, block_k, 1, num_warps=4, num_stages=4).fit(k, k)


def _check(x_q, x_scale, w_q, w_scale) -> tuple[int, int, int]:
    def fail(msg: str) -> None:
        raise ValueError(f"fp8_gemm: {msg}")

    if x_q.dim() != 2 or w_q.dim() != 2 or x_q.shape[1] != w_q.shape[1]:
        fail(f"x_q [M, K] and w_q [N, K] must share K, got {tuple(x_q.shape)} and "
             f"{tuple(w_q.shape)}")  # fmt: skip
    if x_q.dtype != FP8 or w_q.dtype != FP8:
        fail(f"x_q and w_q must be {FP8}, got {x_q.dtype} and {w_q.dtype}")
    (m, k), n = x_q.shape, w_q.shape[0]
    if x_scale.numel() != m or w_scale.numel() != n:
        fail(f"x_scale must hold {m} values and w_scale {n}, got {x_scale.numel()} and "
             f"{w_scale.numel()}")  # fmt: skip
    if k % 32:  # the K loop reads whole tiles of at least 32, unmasked
        fail(f"K={k} must be a multiple of 32")
    return m, n, k


def fp8_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    tiles: IntGemmTiles | None = None,
) -> torch.Tensor:
    """y [M, N] in ``out_dtype`` (see the module docstring); the FP8 layer's ``weight`` is
    the [K, N] view ``_scaled_mm`` takes, so its ``weight.t()`` is ``w_q``. ``tiles``: the
    launch's tiling (default ``choose_fp8_tiles``), fitted to K. No host syncs (CUDA-graph
    capturable). Raises ValueError on bad shapes or dtypes."""
    m, n, k = _check(x_q, x_scale, w_q, w_scale)
    x_q, w_q = x_q.contiguous(), w_q.contiguous()
    xs = x_scale.reshape(m).float().contiguous()
    ws = w_scale.reshape(n).float().contiguous()
    t = tiles.fit(k, k) if tiles else choose_fp8_tiles(m, n, k)
    y = t.output(m, n, out_dtype, x_q.device)
    if m == 0:
        return t.finish(y, out_dtype)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), t.split_k)
    _fp8_gemm_kernel[grid](
        x_q, xs, w_q, ws, y, m, n, k, t.split_k,
        x_q.stride(0), w_q.stride(0), y.stride(-2),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, PARTIAL=t.split_k > 1,
        DOT_FP32=x_q.device.type == "cpu",
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return t.finish(y, out_dtype)


def fp8_gemm_ref(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Plain torch in fp32: dequantize both operands, multiply, round to ``out_dtype``."""
    m, n, _ = _check(x_q, x_scale, w_q, w_scale)
    x = x_q.float() * x_scale.reshape(m, 1).float()
    w = w_q.float() * w_scale.reshape(n, 1).float()
    return (x @ w.t()).to(out_dtype)
