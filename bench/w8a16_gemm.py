"""INT8 weight-only (W8A16, GGUF Q8_0's layout) GEMMs against bf16 on the Llama-3-8B layer
shapes (issue 14).

Per shape (qkv, o, gate_up, down) and token count M, one JSON line, each call timed with a
cold L2, replaying a CUDA graph of it as the engine's decode steps do (gpu_timing):

  bf16_ms        ``F.linear`` with the bf16 weight
  w8a16_ms       ``w8a16_linear`` with its default tiles (what the engine runs);
  sweep          the default tiles and the fastest tiling of bench/int_gemm_sweep.py's
                 (block_m, block_n, block_k, split_k, num_warps, num_stages), with its time
  dequant_ms     ``dequantize_q8_rows`` (the Triton kernel, bf16 weights) + ``F.linear``:
                 the path Int8Method takes from 64 tokens on, and dequant_only_ms its first
                 half alone
  speedup        bf16_ms / w8a16_ms, and best_speedup with the best tile
  weight_gbps    the weight's bytes (int8 codes and fp16 scales) over w8a16_ms: against the
                 H200's ~4,800 GB/s, how bandwidth-bound the small-M kernel is
  rel_error      the W8A16 output against F.linear on the dequantized weight
  eager_ms       bf16 and W8A16 launched from Python instead (host launch work included)

At small M reading the weights bounds both GEMMs, so W8A16 can at best take about half of
bf16's time (8.5 bits a weight against 16).

    python3 bench/w8a16_gemm.py [--tokens 1,16,64,256,1024] [--no-sweep]
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
from tokenmill.kernels.q8_dequantize import dequantize_q8_rows  # noqa: E402
from tokenmill.kernels.w8a16_gemm import dequantize_q8, w8a16_linear  # noqa: E402

GROUP = 32


def q8_weight(out_f: int, in_f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight, scales) on the GPU: random codes, scales near Q8_0's."""
    codes = torch.randint(-128, 128, (out_f, in_f), device="cuda", dtype=torch.int8)
    scales = (torch.rand(out_f, in_f // GROUP, device="cuda") * 1e-4 + 1e-5).half()
    return codes, scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,64,256,1024")
    parser.add_argument("--no-sweep", action="store_true", help="only the default tiles")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/w8a16_gemm.py times CUDA kernels: run it on a GPU")
    warm_up_gpu()
    for name, (in_f, out_f) in LINEAR_SHAPES.items():
        qweight, scales = q8_weight(out_f, in_f)
        weight = dequantize_q8(qweight, scales).to(torch.bfloat16)
        for m in (int(t) for t in args.tokens.split(",")):
            with torch.inference_mode():
                line = shape_line(name, m, "w8a16", w8a16_linear, dequantize_q8_rows,
                                  (qweight, scales), weight, GROUP,
                                  with_sweep=not args.no_sweep)  # fmt: skip
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
