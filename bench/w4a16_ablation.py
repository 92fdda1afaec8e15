"""Where a small-M W4A16 GEMM's time goes: the same grid and tiles with parts of the work
taken out, on the Llama-3-8B qkv and gate_up shapes (issue 14).

Session 13 measured ``w4a16_linear`` at M <= 16 at 250-380 GB/s of packed weights under
every tiling, a fifth of what its dequantization kernel (which also writes 4x the bytes)
streams. Session 14 ran this file: loading the codes alone reached only 0.45-1.4 TB/s, and
the compiled code showed why: one-byte loads, because the compiler could not prove a K run's
start aligned. The kernels (and the modes here) now say so (``tl.multiple_of``), and load 16
bytes at a time through the software pipeline. Each mode below is one Triton kernel over the
same q4-rows weights (kernels/w4a16_gemm.py's layout), timed as a CUDA graph replay on a cold
L2:

  load       load the code bytes and sum them: what the grid and tiles can stream
  codes_dot  split the nibbles and dot them with x, no scales or mins: the unpack and the
             dequantized tile's trip into the tensor cores
  group_dot  the real product with the scales applied after the dots: a batched dot per
             group of raw codes ([G, BM, 16] @ [G, 16, BN]), then each group's sum scaled
             and its mins times the group's sum of x added (no per-weight multiply-add)
  bits_dot   codes_dot with each code made an fp32 from its bits (0x4B000000 | q is 2^23 + q;
             subtract 2^23) instead of an int-to-float conversion, which runs at a quarter of
             an add's rate on the H100/H200: what that conversion costs the kernel
  kernel     w4a16_linear with the same tiles (per-weight scaling, then the dot)

``--modes`` picks the ablations (default load, codes_dot and bits_dot; group_dot ran 1.7-2.5x
slower than the kernel on the H200 in session 14). Tilings: block_n 32/64, block_k 256/512,
4 or 8 warps, each split over K to make about 264 programs (the default's target), 1,056 or
4,224.
Each line: shape, M, tiles (block_m, block_n, block_k, split_k, warps, stages), ms and GB/s
(packed bytes: codes, scales, mins) per mode, after a line with bf16 ``F.linear``'s ms for
the shape and M. group_dot's output is checked against ``w4a16_linear_ref``.

    python3 bench/w4a16_ablation.py [--tokens 1,16] [--modes load,codes_dot,bits_dot,group_dot]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_timing import time_ms, warm_up_gpu  # noqa: E402
from bench.llama8b_shapes import LINEAR_SHAPES  # noqa: E402
from tokenmill.kernels.int_weight_tiles import IntGemmTiles  # noqa: E402
from tokenmill.kernels.w4a16_gemm import pack_q4, w4a16_linear, w4a16_linear_ref  # noqa: E402

GROUP = 32
MODES = {"load": 0, "codes_dot": 1, "group_dot": 2, "bits_dot": 3}
# (block_n, block_k, num_warps): each with split-K making about 264 programs (the default's
# target, two per SM), 1,056 or 4,224 (as many as K / block_k allows).
TILES = [(bn, bk, w) for bn in (32, 64) for bk in (256, 512) for w in (4, 8)]
PROGRAM_TARGETS = (264, 1056, 4224)


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _ablation_kernel(
    x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr,
    M, N, K, SPLIT_K,
    stride_xm, stride_qn, stride_sn, stride_ym,
    MODE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = BLOCK_K // GROUP
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_j = tl.arange(0, BLOCK_K // 2)
    x_lo_k = (offs_j // 16) * 32 + offs_j % 16
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    q_rows = qw_ptr + offs_n[:, None].to(tl.int64) * stride_qn
    k_run = K // SPLIT_K
    k_first = tl.program_id(2) * k_run
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_first, k_first + k_run, BLOCK_K):
        offs_b = tl.max_contiguous(tl.multiple_of(k0 // 2 + offs_j, BLOCK_K // 2), BLOCK_K // 2)
        b = tl.load(q_rows + offs_b[None, :], mask=mask_n[:, None], other=0)
        if MODE == 0:
            acc += tl.sum(b.to(tl.int32), axis=1)[None, :].to(tl.float32)
        else:
            offs_x = tl.max_contiguous(tl.multiple_of(k0 + x_lo_k, 16), 16)
            x_lo = tl.load(x_rows + offs_x[None, :], mask=mask_m[:, None], other=0.0)
            x_hi = tl.load(x_rows + (offs_x + 16)[None, :], mask=mask_m[:, None], other=0.0)
            if MODE == 3:  # fp32 from the bits: 0x4B000000 | q is 2^23 + q, no int-to-float
                lo = ((b & 0xF).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
                hi = ((b >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
                lo = (lo - 8388608.0).to(x_lo.dtype)
                hi = (hi - 8388608.0).to(x_lo.dtype)
            else:
                lo = (b & 0xF).to(x_lo.dtype)  # codes 0..15: exact in bf16
                hi = (b >> 4).to(x_lo.dtype)
            if MODE == 1 or MODE == 3:
                acc += tl.dot(x_lo, tl.trans(lo))
                acc += tl.dot(x_hi, tl.trans(hi))
            else:  # per group: [G, BM, 16] @ [G, 16, BN], scaled after
                xg_lo = tl.permute(tl.reshape(x_lo, [BLOCK_M, G, GROUP // 2]), (1, 0, 2))
                xg_hi = tl.permute(tl.reshape(x_hi, [BLOCK_M, G, GROUP // 2]), (1, 0, 2))
                qg_lo = tl.permute(tl.reshape(lo, [BLOCK_N, G, GROUP // 2]), (1, 2, 0))
                qg_hi = tl.permute(tl.reshape(hi, [BLOCK_N, G, GROUP // 2]), (1, 2, 0))
                d = tl.dot(xg_lo, qg_lo) + tl.dot(xg_hi, qg_hi)  # [G, BM, BN]
                offs_g = k0 // GROUP + tl.arange(0, G)
                sp = s_ptr + offs_n[None, :].to(tl.int64) * stride_sn + offs_g[:, None]
                mp = m_ptr + offs_n[None, :].to(tl.int64) * stride_sn + offs_g[:, None]
                s = tl.load(sp, mask=mask_n[None, :], other=0.0).to(tl.float32)  # [G, BN]
                mn = tl.load(mp, mask=mask_n[None, :], other=0.0).to(tl.float32)
                xsum = tl.sum(xg_lo.to(tl.float32) + xg_hi.to(tl.float32), axis=2)  # [G, BM]
                acc += tl.sum(d * s[:, None, :] + xsum[:, :, None] * mn[:, None, :], axis=0)
    y = y_ptr + tl.program_id(2).to(tl.int64) * M * N
    y += offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc, mask=mask_m[:, None] & mask_n[None, :])


def ablation(mode: str, x, qw, s, mn, t: IntGemmTiles) -> torch.Tensor:
    m, k = x.shape
    n = qw.shape[0]
    y = torch.empty(t.split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), t.split_k)
    _ablation_kernel[grid](
        x, qw, s, mn, y, m, n, k, t.split_k, x.stride(0), qw.stride(0), s.stride(0), y.stride(1),
        MODE=MODES[mode], GROUP=GROUP, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return y.sum(0) if t.split_k > 1 else y[0]


def tile_line(
    name: str, x, qw, s, mn, t: IntGemmTiles, want: torch.Tensor, modes: list[str]
) -> dict:
    """The ``modes`` and the real kernel at one tiling."""
    nbytes = qw.numel() + 2 * s.numel() * 2
    line = {"shape": name, "M": x.shape[0], "tiles": list(vars(t).values())[:6]}
    with torch.inference_mode():
        for mode in modes:
            ms = time_ms(lambda mode=mode: ablation(mode, x, qw, s, mn, t), graph=True)
            line[mode] = [round(ms, 4), round(nbytes / ms / 1e6)]
        ms = time_ms(lambda: w4a16_linear(x, qw, s, mn, tiles=t), graph=True)
        line["kernel"] = [round(ms, 4), round(nbytes / ms / 1e6)]
        if "group_dot" in modes:
            got = ablation("group_dot", x, qw, s, mn, t)
            line["group_dot_rel_error"] = round(((got - want).norm() / want.norm()).item(), 5)
    return line


def shape_lines(name: str, m: int, modes: list[str]) -> None:
    """The bf16 line, then one line per tiling, for one shape and M."""
    in_f, out_f = LINEAR_SHAPES[name]
    codes = torch.randint(0, 16, (out_f, in_f), device="cuda")
    s = (torch.rand(out_f, in_f // GROUP, device="cuda") * 0.002 + 0.0005).half()
    mn = (-8 * s.float()).half()
    qw = pack_q4(codes)
    x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
    bf16_ms = time_ms(lambda: torch.nn.functional.linear(x, weight), graph=True)
    print(json.dumps({"shape": name, "M": m, "bf16_ms": round(bf16_ms, 4)}), flush=True)
    want = w4a16_linear_ref(x.float(), qw, s, mn)
    for block_n, block_k, warps in TILES:
        for target in PROGRAM_TARGETS:
            split = max(1, target // triton.cdiv(out_f, block_n))
            t = IntGemmTiles(16, block_n, block_k, split, warps, 3).fit(in_f, GROUP)
            print(json.dumps(tile_line(name, x, qw, s, mn, t, want, modes)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16")
    parser.add_argument("--modes", default="load,codes_dot,bits_dot", help=f"of {','.join(MODES)}")
    args = parser.parse_args()
    warm_up_gpu()
    for name in ("qkv", "gate_up"):
        for m in (int(t) for t in args.tokens.split(",")):
            shape_lines(name, m, args.modes.split(","))


if __name__ == "__main__":
    main()
