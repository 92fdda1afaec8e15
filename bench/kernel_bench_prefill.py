"""Paged prefill attention (Triton) against SDPA's flash backend, on CUDA.

Workload: causal full prefill, Llama-3-8B attention shapes (32 query heads, 8 KV heads,
head dim 128), bf16, ~16k tokens per batch: 8 x 2k, 4 x 4k, 2 x 8k; K/V read through the
paged cache with block size 16 and 128 (random block order). The peer is
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` under
``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` on contiguous [B, H, L, d] tensors of the same
data. Times are ``bench.gpu_timing.time_ms`` medians (L2 flushed clean before each call).
FLOPs (two matmuls, half the score matrix kept by the causal mask):

    flops = 4 * sum_b(q_len_b * k_len_b / 2) * Hq * d       (= 2 * B * L^2 * Hq * d here)

Ceiling: the measured bf16 dense-matmul rate of the H200, 795 TFLOP/s. Before timing, the
kernel is checked against ``paged_prefill_attention_ref`` on a ragged batch with cached
prefixes, and every timed shape against SDPA's output.

    PYTHONPATH=$PWD python3 bench/kernel_bench_prefill.py [--sweep] [--json PATH]
        [--layout llama3-8b|smollm2]

``--layout smollm2`` runs the embedded default model's heads (9 query / 3 KV, d 64) instead.

``--sweep`` also times a few tile configurations (rows tagged with their config), among them
``read_new_keys`` (the prompt's own keys read from contiguous k/v rows, not the block table).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_timing import time_ms, warm_up_gpu  # noqa: E402
from tokenmill.kernels.paged_prefill_attention import (  # noqa: E402
    PrefillAttentionConfig,
    default_prefill_config,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)


@dataclass(frozen=True)
class Heads:
    """Query heads, KV heads, head dim."""

    hq: int
    hkv: int
    d: int

    def __str__(self) -> str:  # as the shape labels print it
        return f"hq{self.hq} hkv{self.hkv} d{self.d}"


# the shape (Llama-3-8B) and the embedded default model's
LAYOUTS = {"llama3-8b": Heads(32, 8, 128), "smollm2": Heads(9, 3, 64)}
DTYPE = torch.bfloat16
SHAPES = [(8, 2048), (4, 4096), (2, 8192)]  # (requests, tokens each): 16k tokens per batch
BLOCK_SIZES = [16, 128]
# checked against the torch reference before timing: cached prefixes, a single query
CHECK_REQUESTS = [(1024, 1024), (300, 1500), (1, 777), (129, 4000)]
DEVICE = "cuda"
CEILING_TFLOPS = 795
# bf16: P is rounded to bf16 before P @ V and both sides round the output, one ulp being
# 2^-8 relative (as in tests/kernels/test_paged_prefill_attention.py)
ATOL = RTOL = 1.6e-2

SWEEP = [
    PrefillAttentionConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
    PrefillAttentionConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    PrefillAttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
    PrefillAttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, pack_gqa=False),
    # the step's own keys read from k_new/v_new rows instead of through the block table
    PrefillAttentionConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, read_new_keys=True),
    PrefillAttentionConfig(block_m=128, block_n=128, num_warps=8, num_stages=2, read_new_keys=True),
    PrefillAttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, read_new_keys=True),
    # d 64's default tile with the new keys (--layout smollm2)
    PrefillAttentionConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, read_new_keys=True),
]


def causal_flops(q_lens: list[int], k_lens: list[int], hq: int, d: int) -> float:
    """Two matmuls over the keys each query sees: all of the cached context (k - q) and half
    of the request's own q x q block."""
    pairs = sum(q * (k - q) + q * q / 2 for q, k in zip(q_lens, k_lens, strict=True))
    return 4 * pairs * hq * d


def paged_batch(
    requests: list[tuple[int, int]], block_size: int, heads: Heads, seed: int = 0
) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """Kernel arguments for ``requests`` = [(q_len, seq_len)], plus the contiguous K/V each
    request's context was written from (``[sum(seq_len), Hkv, d]``, requests back to back)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q_lens = [q for q, _ in requests]
    seq_lens = [s for _, s in requests]
    # data first: the same for every block size (the SDPA output is shared across them)
    hq, hkv, d = heads.hq, heads.hkv, heads.d
    k = torch.randn(sum(seq_lens), hkv, d, generator=g, device=DEVICE, dtype=DTYPE)
    v = torch.randn(sum(seq_lens), hkv, d, generator=g, device=DEVICE, dtype=DTYPE)
    q = torch.randn(sum(q_lens), hq, d, generator=g, device=DEVICE, dtype=DTYPE)
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req)
    perm = torch.randperm(num_blocks, generator=g, device=DEVICE).to(torch.int32)
    block_tables = torch.zeros(len(requests), max(blocks_per_req), dtype=torch.int32, device=DEVICE)
    slots = []
    used = 0
    for b, (n, s) in enumerate(zip(blocks_per_req, seq_lens, strict=True)):
        block_tables[b, :n] = perm[used : used + n]
        used += n
        pos = torch.arange(s, device=DEVICE)
        slots.append(block_tables[b, pos // block_size].long() * block_size + pos % block_size)
    kv = torch.zeros(2, num_blocks, block_size, hkv, d, device=DEVICE, dtype=DTYPE)
    kv.view(2, -1, hkv, d)[0, torch.cat(slots)] = k  # kv: [2, NB, BS, Hkv, d]
    kv.view(2, -1, hkv, d)[1, torch.cat(slots)] = v
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (
        q,  # [T, Hq, d]
        kv[0],  # [NB, BS, Hkv, d]
        kv[1],
        block_tables,  # [B, max_blocks]
        qsl.to(DEVICE),  # [B + 1]
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),  # [B]
        max(q_lens),
        d**-0.5,
    )
    return args, k, v


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, Hq, L, d], k/v: [B, Hkv, L, d]; GQA natively, else by repeating K/V heads."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        except RuntimeError:  # a torch whose flash backend rejects enable_gqa
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def check_against_ref(heads: Heads) -> float:
    """Max abs error vs the torch reference on a ragged batch with cached prefixes; raises
    RuntimeError past ATOL + RTOL * |ref| (or on NaN)."""
    worst = 0.0
    for block_size in BLOCK_SIZES:
        args, _, _ = paged_batch(CHECK_REQUESTS, block_size, heads)
        out = paged_prefill_attention(*args).float()
        ref = paged_prefill_attention_ref(*args).float()
        err = (out - ref).abs()
        worst = max(worst, err.max().item())
        if not (err <= ATOL + RTOL * ref.abs()).all():
            raise RuntimeError(
                f"paged_prefill_attention is off the reference (block size {block_size}): "
                f"max abs error {err.max().item():.3g}"
            )
    return worst


def time_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_reqs: int, seq_len: int, scale: float
) -> tuple[float, torch.Tensor]:
    """SDPA flash on the same data laid out [B, H, L, d]: (median ms, output as [T, Hq, d])."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    qs = q.view(num_reqs, seq_len, hq, d).transpose(1, 2).contiguous()  # [B, Hq, L, d]
    ks = k.view(num_reqs, seq_len, hkv, d).transpose(1, 2).contiguous()  # [B, Hkv, L, d]
    vs = v.view(num_reqs, seq_len, hkv, d).transpose(1, 2).contiguous()
    out = sdpa_flash(qs, ks, vs, scale).transpose(1, 2).reshape(-1, hq, d)
    return time_ms(lambda: sdpa_flash(qs, ks, vs, scale)), out


def time_kernel(
    args: tuple,
    config: PrefillAttentionConfig,
    expected: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    fresh: bool,
) -> tuple[float, float]:
    """(median ms, max abs error vs ``expected``) of the kernel with ``config``; ``k_new`` /
    ``v_new`` are the step's own keys (all of a full prefill's, a chunk's last rows), used
    when the config says ``read_new_keys``; ``fresh``: no cached context, as the engine
    tells the kernel."""
    out = torch.empty_like(args[0])

    def run() -> torch.Tensor:
        return paged_prefill_attention(
            *args, out=out, config=config, k_new=k_new, v_new=v_new, fresh=fresh
        )

    run()
    err = (out.float() - expected.float()).abs().max().item()
    return time_ms(run), err


def _variants(
    configs: list[PrefillAttentionConfig | None], block_size: int
) -> list[tuple[PrefillAttentionConfig | None, bool]]:
    """(config, fresh) pairs to time. The workload is fresh prompts, so the kernel is told
    ``fresh`` as the engine would; the default and swept ``read_new_keys`` configs are also
    timed without it (the variant a step with any cached prefix runs)."""
    pairs: list[tuple[PrefillAttentionConfig | None, bool]] = []
    for cfg in configs:
        pairs.append((cfg, True))
        if cfg is None or cfg.read_new_keys:
            pairs.append((cfg, False))
    return pairs


def benchmark(
    configs: list[PrefillAttentionConfig | None] | None = None, heads: Heads = LAYOUTS["llama3-8b"]
) -> list[dict]:
    """One row per (shape, block size, config); ``None`` in ``configs`` = the default."""
    if not torch.cuda.is_available():
        raise RuntimeError("kernel_bench_prefill needs a CUDA GPU")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the benchmark times compiled kernels")
    warm_up_gpu()
    configs = configs or [None]
    ref_err = check_against_ref(heads)
    rows = []
    for num_reqs, seq_len in SHAPES:
        flops = causal_flops([seq_len] * num_reqs, [seq_len] * num_reqs, heads.hq, heads.d)
        sdpa = None  # (ms, out): the same data for every block size, timed once per shape
        for block_size in BLOCK_SIZES:
            args, k, v = paged_batch([(seq_len, seq_len)] * num_reqs, block_size, heads)
            if sdpa is None:
                sdpa = time_sdpa(args[0], k, v, num_reqs, seq_len, args[-1])
            for cfg, fresh in _variants(configs, block_size):
                used = cfg or default_prefill_config(heads.d, DTYPE, fresh)
                ms, err = time_kernel(args, used, sdpa[1], k, v, fresh)
                shape = f"{num_reqs}x{seq_len} bs{block_size} {heads} bf16"
                rows.append(
                    make_row(shape, flops, ms, sdpa[0], used, cfg is None, fresh, err, ref_err)
                )
    return rows


def make_row(
    shape: str,
    flops: float,
    ms: float,
    sdpa_ms: float,
    config: PrefillAttentionConfig,
    default: bool,
    fresh: bool,
    err: float,
    ref_err: float,
) -> dict:
    """One timed (shape, config): the JSON row ``print_rows`` and bench/kernel_bench.py read."""
    return {
        "kernel": "prefill",
        "shape": shape,
        "ms": round(ms, 4),
        "tflops": round(flops / ms / 1e9, 1),
        "sdpa_ms": round(sdpa_ms, 4),
        "sdpa_tflops": round(flops / sdpa_ms / 1e9, 1),
        "ceiling_tflops": CEILING_TFLOPS,
        "config": {**vars(config), "default": default},
        "fresh": fresh,
        "max_abs_err_vs_sdpa": round(err, 5),
        "max_abs_err_vs_ref": round(ref_err, 5),
        "gpu": torch.cuda.get_device_name(),
    }


def print_rows(rows: list[dict]) -> None:
    """The rows as a table, configs tagged (``ctx``: a ``read_new_keys`` config run without
    ``fresh``, its block-table code compiled in)."""
    head = ("shape", "config", "ms", "TFLOP/s", "SDPA ms", "SDPA TF/s", "err")
    print("{:<40} {:<24} {:>8} {:>8} {:>8} {:>9} {:>8}".format(*head))
    for r in rows:
        c = r["config"]
        tag = f"{c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']}"
        tag += ("" if c["pack_gqa"] else " nopack") + (" new-kv" if c["read_new_keys"] else "")
        tag += "" if r["fresh"] or not c["read_new_keys"] else " ctx"
        tag += " *" if c["default"] else ""
        print(
            f"{r['shape']:<40} {tag:<24} {r['ms']:>8.3f} {r['tflops']:>8.1f} "
            f"{r['sdpa_ms']:>8.3f} {r['sdpa_tflops']:>9.1f} {r['max_abs_err_vs_sdpa']:>8.4f}"
        )
    print(f"ceiling {CEILING_TFLOPS} TFLOP/s (bf16 dense matmul); * = default config")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time the SWEEP configs")
    parser.add_argument("--json", type=Path, help="write the rows here (default: $OUT if set)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="llama3-8b")
    args = parser.parse_args()
    rows = benchmark([None, *SWEEP] if args.sweep else None, LAYOUTS[args.layout])
    path = args.json
    if path is None and "OUT" in os.environ:
        path = Path(os.environ["OUT"]) / "kernel_bench_prefill.json"
    if path:
        path.write_text(json.dumps(rows, indent=2))
    print_rows(rows)


if __name__ == "__main__":
    main()
