"""INT4 weight-only (W4A16) GEMMs against bf16 on the Llama-3-8B layer shapes (issue 14).

Goals: the W4A16 GEMM >= 3x the bf16 GEMM at M <= 16, and never slower than bf16 at
M = 256 (where a dequantize + bf16 GEMM would do, if it is faster).

Per shape (qkv, o, gate_up, down) and token count M, one JSON line, each call timed with a
cold L2, replaying a CUDA graph of it as the engine's decode steps do (gpu_timing):

  bf16_ms        ``F.linear`` with the bf16 weight
  w4a16_ms       ``w4a16_linear`` with its default tiles (what the engine runs);
  sweep          the default tiles and the fastest tiling of bench/int_gemm_sweep.py's
                 (block_m, block_n, block_k, split_k, num_warps, num_stages), with its time
  dequant_ms     ``dequantize_q4_rows`` (the Triton kernel, bf16 weights) + ``F.linear``:
                 the dequantize-then-GEMM path a large-M switch would take, and
                 dequant_only_ms its first half alone
  speedup        bf16_ms / w4a16_ms, and best_speedup with the best tile
  weight_gbps    the packed weight's bytes (codes, scales, mins) over w4a16_ms: against the
                 H200's ~4,800 GB/s, how bandwidth-bound the small-M kernel is
  rel_error      the W4A16 output against F.linear on the dequantized weight
  eager_ms       bf16 and W4A16 launched from Python instead (host launch work included)

The weights are random 4-bit codes with fp16 scales and mins per group of 32 (GGUF Q4_1's
layout and group).

    python3 bench/w4a16_gemm.py [--tokens 1,16,64,256,1024,4096] [--no-sweep]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_timing import warm_up_gpu  # noqa: E402
from bench.int_gemm_sweep import shape_line  # noqa: E402
from bench.llama8b_shapes import LINEAR_SHAPES  # noqa: E402
from tokenmill.kernels.q4_dequantize import dequantize_q4_rows  # noqa: E402
from tokenmill.kernels.w4a16_gemm import dequantize_q4, pack_q4, w4a16_linear  # noqa: E402

SHAPES = LINEAR_SHAPES  # name: (in, out)
GROUP = 32


def q4_weight(out_f: int, in_f: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight, scales, mins) on the GPU: random codes, scales and mins near Q4_1's."""
    codes = torch.randint(0, 16, (out_f, in_f), device="cuda")
    scales = (torch.rand(out_f, in_f // GROUP, device="cuda") * 0.002 + 0.0005).half()
    mins = (-8 * scales.float()).half()
    return pack_q4(codes), scales, mins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,64,256,1024,4096")
    parser.add_argument("--no-sweep", action="store_true", help="only the default tiles")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/w4a16_gemm.py times CUDA kernels: run it on a GPU")
    warm_up_gpu()
    for name, (in_f, out_f) in SHAPES.items():
        qweight, scales, mins = q4_weight(out_f, in_f)
        weight = dequantize_q4(qweight, scales, mins).to(torch.bfloat16)
        for m in (int(t) for t in args.tokens.split(",")):
            with torch.inference_mode():
                line = shape_line(name, m, "w4a16", w4a16_linear, dequantize_q4_rows,
                                  (qweight, scales, mins), weight, GROUP,
                                  with_sweep=not args.no_sweep, code_bits=4)  # fmt: skip
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
