"""How the weight-only integer GEMMs (w4a16_gemm.py, w8a16_gemm.py) cut a call into
programs (the FP8 GEMM, fp8_gemm.py, takes the same tiles), and the two steps their kernels
share: ``tile_dot`` (a dequantized tile into the accumulator) and ``store_tile`` (the
accumulator into ``IntGemmTiles.output``'s buffer).

Tiles. A program computes a [BLOCK_M, BLOCK_N] tile of y over a run of K, BLOCK_K inputs at a
time; with SPLIT_K > 1 the K axis is cut into SPLIT_K equal runs whose programs each write
their partial tile to an fp32 buffer [SPLIT_K, M, N], summed over the runs in a fixed order
and rounded to the output dtype (no atomics: the result is the same bits every run, as CUDA
graphs against eager steps and reproducible jobs need).

- Small M (decode): reading the packed weights is the whole cost, so each program streams a
  long run of K (BLOCK_K 256: 128 bytes of a 4-bit row, 256 of an 8-bit one, per load) and
  split-K makes enough programs to keep every SM loading: an 8B layer with N = 4,096 and
  BLOCK_N = 64 has only 64 column tiles for 132 SMs.
- Large M (prefill): tensor-core work dominates and the weights are re-read once per M tile,
  so tiles are large in M and N and K is not split.
- ``mma=False`` (a few rows of x): no tensor-core dot; each program multiplies its
  dequantized [BLOCK_N, BLOCK_K] tile by x's rows and sums over K in registers, skipping the
  trip of the dequantized tile through shared memory that a dot takes. Its registers grow as
  BLOCK_M * BLOCK_N * BLOCK_K, so it suits M of 1 to 4.

Measured on the H200 (BENCHMARKS.md, sessions 13-14): at M <= 16 every tiling of
bench/int_gemm_sweep.py ran within ~10% of the others, at 250-380 GB/s of packed weights,
well under bf16's own GEMM; more programs (split-K to ~1,000 or ~4,000) or 8 warps did not
help. The compiled kernels loaded their codes one byte at a time (a K run's start was not
known to be aligned); they now load 16 bytes at a time through the software pipeline
(tests/kernels/test_wide_loads.py), not yet timed on the GPU. These defaults are the sweep's
typical winners, not a tuned optimum.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["IntGemmTiles", "choose_tiles", "fit_block_k", "store_tile", "tile_dot"]

_TARGET_PROGRAMS = 264  # two per SM of an H200 (132 SMs)


@dataclass(frozen=True)
class IntGemmTiles:
    """One launch's tiling: see the module docstring. ``block_k`` must divide K (and be a
    multiple or a divisor of the weights' group); ``split_k`` must divide K / block_k."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    mma: bool = True

    def fit(self, k: int, group: int) -> IntGemmTiles:
        """These tiles with block_k and split_k cut down until they fit K and the group."""
        block_k = fit_block_k(self.block_k, k, group)
        split = max(1, min(self.split_k, k // block_k))
        while (k // block_k) % split:
            split -= 1
        return dataclasses.replace(self, block_k=block_k, split_k=split)

    def output(self, m: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer the kernel writes: y [m, n] in ``dtype``, or with split-K one fp32
        partial tile per K run, [split_k, m, n] (summed in a fixed order by ``finish``)."""
        if self.split_k > 1:
            return torch.empty(self.split_k, m, n, dtype=torch.float32, device=device)
        return torch.empty(m, n, dtype=dtype, device=device)

    def finish(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``output``'s buffer after the kernel -> y [m, n] in ``dtype``."""
        return y if self.split_k == 1 else y.sum(0).to(dtype)


def fit_block_k(block_k: int, k: int, group: int) -> int:
    """``block_k`` halved until it divides K and is a multiple or a divisor of the group
    (every K and group here are multiples of 32, so 32 always fits)."""
    while block_k > 32 and (k % block_k or (group % block_k and block_k % group)):
        block_k //= 2
    return block_k


def choose_tiles(m: int, n: int, k: int, group: int, code_bits: int = 8) -> IntGemmTiles:
    """The default tiles for an [m, k] @ [k, n] weight-only GEMM of ``code_bits``-bit codes
    (fitted to k and group). 4-bit codes at m <= 16 take narrow column tiles and long K runs,
    split over K only below two programs per SM: on the H200 (session 15, qkv at M = 1 and
    16) that was the fastest tiling of the sweep, 25% under 64-column tiles split in two
    (a split also costs the partials' sum)."""
    if m <= 16 and code_bits == 4:
        split = max(1, _TARGET_PROGRAMS // triton.cdiv(n, 32))
        return IntGemmTiles(16, 32, 512, split, num_warps=4, num_stages=3).fit(k, group)
    if m <= 64:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        programs = triton.cdiv(m, block_m) * triton.cdiv(n, 64)
        split = max(1, _TARGET_PROGRAMS // programs)
        return IntGemmTiles(block_m, 64, 256, split, num_warps=4, num_stages=3).fit(k, group)
    block_m = 64 if m <= 128 else 128
    return IntGemmTiles(block_m, 128, 64, 1, num_warps=8, num_stages=3).fit(k, group)


@triton.jit
def tile_dot(acc, x, w, MMA: tl.constexpr, DOT_FP32: tl.constexpr):
    """``acc`` [BLOCK_M, BLOCK_N] fp32 plus x [BLOCK_M, k] @ w [BLOCK_N, k]^T, w dequantized
    in fp32: a tensor-core dot with w rounded to x's dtype, an exact fp32 one (``DOT_FP32``:
    fp32 inputs, or the interpreter), or without ``MMA`` a multiply and sum over k on CUDA
    cores (no trip of w through shared memory)."""
    if not MMA:  # [BM, 1, k] * [1, BN, k], summed over k
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    elif DOT_FP32:
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    else:
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    return acc


@triton.jit
def store_tile(y_ptr, acc, offs_m, offs_n, M, N, stride_ym, stride_yn, PARTIAL: tl.constexpr):
    """A program's fp32 tile into ``IntGemmTiles.output``'s buffer: with ``PARTIAL`` (split-K)
    its K run's slice of [SPLIT_K, M, N] (run ``program_id(2)``), else y rounded to its
    dtype; rows past M and columns past N are not written."""
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if PARTIAL:
        tl.store(y + tl.program_id(2).to(tl.int64) * M * N, acc, mask=mask)
    else:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)
