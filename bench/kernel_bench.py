"""All Triton kernel benchmarks in one call: prefill attention (TFLOP/s vs SDPA flash), decode
attention (TB/s vs the 4.25 TB/s ceiling, gather+SDPA as peer), and the fused RMSNorm, RoPE
and SiLU-and-mul kernels (TB/s vs the ceiling, torch as peer). Each module checks its kernel
against the reference before timing.

    PYTHONPATH=$PWD python3 bench/kernel_bench.py [--sweep] [--only prefill,decode,elementwise]

Writes every row to $OUT/kernels.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import kernel_bench_decode, kernel_bench_elementwise, kernel_bench_prefill  # noqa: E402


def _line(row: dict) -> str:
    if "tflops" in row:
        # a step with any cached prefix runs the kernel with its block-table code compiled in
        shape = row["shape"] + ("" if row.get("fresh", True) else " (ctx code)")
        return (
            f"{row['kernel']:<10} {shape:<40} {row['ms']:8.3f} ms "
            f"{row['tflops']:7.1f} TFLOP/s (SDPA {row.get('sdpa_tflops', float('nan')):6.1f}, "
            f"ceiling {row['ceiling_tflops']})"
        )
    peer = row.get("torch_ms", row.get("peer_ms"))
    peer_txt = f", peer {peer:.3f} ms" if isinstance(peer, (int, float)) else ""
    copy = row.get("pct_of_same_size_copy")
    copy_txt = f" ({copy:.1f}% of a same-size copy)" if copy is not None else ""
    return (
        f"{row['kernel']:<10} {row['shape']:<40} {row['ms']:8.3f} ms "
        f"{row['tbps']:6.2f} TB/s = {row['pct_of_ceiling']:5.1f}% of "
        f"{row['ceiling_tbps']}{copy_txt}{peer_txt}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time tuning variants")
    parser.add_argument("--only", default="prefill,decode,elementwise")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(0), "torch", torch.__version__, flush=True)
    rows: list[dict] = []
    for name in args.only.split(","):
        start = time.monotonic()
        if name == "prefill":
            configs = [None, *kernel_bench_prefill.SWEEP] if args.sweep else None
            got = kernel_bench_prefill.benchmark(configs)
        elif name == "decode":
            got = kernel_bench_decode.benchmark(sweep=args.sweep)
        else:
            got = kernel_bench_elementwise.benchmark()
            if args.sweep:
                got += kernel_bench_elementwise.sweep()
        rows.extend(got)
        print(f"[{name}: {len(got)} rows in {time.monotonic() - start:.0f} s]", flush=True)
    print()
    for row in rows:
        print(_line(row))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "kernels.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
