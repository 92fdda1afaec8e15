"""Paged prefill attention on chunks with cached context (a chunked-prefill or prefix-hit step).

Workload: each request's last ``q`` tokens attend to all ``k`` of its keys, the first
``k - q`` of which are already in the paged cache: 4 x (1024 new over 4096) and 2 x (2048
over 8192), block size 16 and 128, in the layouts of ``kernel_bench_prefill``. The kernel
runs as the engine calls it for such a step: the step's own keys from its k/v rows
(``read_new_keys``), the context through the block table, and not ``fresh``. The peer is
``F.scaled_dot_product_attention`` with a lower-right causal mask (torch picks the kernel)
on contiguous [B, H, L, d] tensors of the same data. FLOPs as in ``causal_flops``.

    PYTHONPATH=$PWD python3 bench/kernel_bench_prefill_context.py [--sweep]
        [--layout llama3-8b|smollm2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_timing import time_ms, warm_up_gpu  # noqa: E402
from bench.kernel_bench_prefill import (  # noqa: E402
    BLOCK_SIZES,
    DTYPE,
    LAYOUTS,
    SWEEP,
    Heads,
    causal_flops,
    check_against_ref,
    make_row,
    paged_batch,
    print_rows,
    time_kernel,
)
from tokenmill.kernels.paged_prefill_attention import (  # noqa: E402
    PrefillAttentionConfig,
    default_prefill_config,
)

SHAPES = [(4, 1024, 4096), (2, 2048, 8192)]  # (requests, new tokens each, keys each)


def _own_rows(x: torch.Tensor, num_reqs: int, q_len: int, seq_len: int) -> torch.Tensor:
    """The last ``q_len`` rows of each request's ``seq_len`` rows of ``x`` (requests back to
    back): the keys or values this step stored."""
    return x.view(num_reqs, seq_len, *x.shape[1:])[:, seq_len - q_len :].reshape(-1, *x.shape[1:])


def _sdpa_lower_right(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_reqs: int, seq_len: int, scale: float
) -> tuple[float, torch.Tensor]:
    """SDPA on the same data laid out [B, H, L, d], queries aligned to the end of the keys:
    (median ms, output as [T, Hq, d])."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    q_len = q.shape[0] // num_reqs
    qs = q.view(num_reqs, q_len, hq, d).transpose(1, 2).contiguous()
    ks = k.view(num_reqs, seq_len, hkv, d).transpose(1, 2).contiguous()
    vs = v.view(num_reqs, seq_len, hkv, d).transpose(1, 2).contiguous()
    mask = causal_lower_right(q_len, seq_len)
    gqa = {"enable_gqa": True}
    try:
        F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, **gqa)
    except (RuntimeError, TypeError):  # a torch whose causal bias rejects enable_gqa
        ks, vs = (x.repeat_interleave(hq // hkv, dim=1) for x in (ks, vs))
        gqa = {}

    def run() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, **gqa)

    return time_ms(run), run().transpose(1, 2).reshape(-1, hq, d)


def benchmark(
    configs: list[PrefillAttentionConfig | None] | None = None, heads: Heads = LAYOUTS["llama3-8b"]
) -> list[dict]:
    """One row per (shape, block size, config); ``None`` in ``configs`` = the default."""
    if not torch.cuda.is_available():
        raise RuntimeError("kernel_bench_prefill_context needs a CUDA GPU")
    warm_up_gpu()
    configs = configs or [None]
    ref_err = check_against_ref(heads)
    rows = []
    for num_reqs, q_len, seq_len in SHAPES:
        flops = causal_flops([q_len] * num_reqs, [seq_len] * num_reqs, heads.hq, heads.d)
        sdpa = None  # (ms, out), the same data for every block size
        for block_size in BLOCK_SIZES:
            args, k, v = paged_batch([(q_len, seq_len)] * num_reqs, block_size, heads)
            if sdpa is None:
                sdpa = _sdpa_lower_right(args[0], k, v, num_reqs, seq_len, args[-1])
            k_new, v_new = (_own_rows(x, num_reqs, q_len, seq_len) for x in (k, v))
            for cfg in configs:
                used = cfg or default_prefill_config(heads.d, DTYPE, fresh=False)
                ms, err = time_kernel(args, used, sdpa[1], k_new, v_new, fresh=False)
                shape = f"{num_reqs}x({q_len} of {seq_len}) bs{block_size} {heads}"
                rows.append(
                    make_row(shape, flops, ms, sdpa[0], used, cfg is None, False, err, ref_err)
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also the read_new_keys SWEEP configs")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="llama3-8b")
    args = parser.parse_args()
    swept = [c for c in SWEEP if c.read_new_keys]
    rows = benchmark([None, *swept] if args.sweep else None, LAYOUTS[args.layout])
    if "OUT" in os.environ:
        name = f"kernel_bench_prefill_context_{args.layout}.json"
        Path(os.environ["OUT"], name).write_text(json.dumps(rows, indent=2))
    print_rows(rows)


if __name__ == "__main__":
    main()
