"""Paged decode attention (flash-decoding, split-K) on a GPU: HBM bandwidth against the ceiling.

Workload: Llama-3-8B decode layout (32 q / 8 kv heads, d 128, bf16), block_size 16 and 128,
batch 64 and 256, every request at the same context of 1k / 4k / 16k tokens (a shape whose
K+V passes ~60 GB is skipped), random non-contiguous block tables. Each shape is checked
against a peer first, then timed with ``bench.gpu_timing.time_ms`` (median; L2 flushed clean
before each call). Bandwidth counts the K and V bytes that must be read, sum over requests of
seq_len * Hkv * d * 2 (K and V) * 2 (bytes of bf16), against the 4.25 TB/s device-to-device
copy ceiling measured on the H200. q, out and the fp32 split partials are not counted
(about 2% of the K/V bytes at batch 64 and 1k, under 0.5% from 4k).

Peer, same shape, same run: the torch backend's decode path, gather the blocks with
``index_select`` then one masked SDPA call (q viewed as [B, Hkv, G, d] so K/V are not
repeated per query head); its time includes the gather, as in the engine.

    PYTHONPATH=$PWD python3 bench/kernel_bench_decode.py [--sweep] [--kv-dtype fp8]
                            [--batches 256] [--contexts 4096] [--block-sizes 16] [--out F]

``--kv-dtype fp8``: the cache holds e4m3 values (``engine.kv_cache_dtype: fp8``) and bandwidth
counts their 1-byte elements (issue 14's goal: >= 80% of the ceiling at 4k+ context). The peer
is then the same kernel on a bf16 cache holding the same values (``bf16_ms``), so
``bf16_ms / ms`` is what the FP8 cache saves; per byte, FP8 is no slower than bf16 when that
ratio is >= 2.

Below the context, the fixed split boundaries the engine could use (every 256, 512, 1,024 and
2,048 keys, a merge whenever there are several splits) are timed too. ``--sweep`` also times
block_n, num_warps, num_stages and num_splits variants on the 4k and 16k shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_timing import time_ms, warm_up_gpu  # noqa: E402
from tokenmill.kernels.fp8_kv import FP8_KV, to_kv_cache  # noqa: E402
from tokenmill.kernels.paged_decode_attention import (  # noqa: E402
    MAX_SPLITS,
    DecodeWorkspace,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)

CEILING_TBPS = 4.25  # H200 device-to-device copy, measured (see BENCHMARKS.md)
MAX_KV_BYTES = 60e9
HQ, HKV, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
BATCHES = (64, 256)
CONTEXTS = (1024, 4096, 16384)
BLOCK_SIZES = (16, 128)
# bf16 output rounding (2^-8 relative) plus P rounded to bf16 before the P@V dot.
ATOL = RTOL = 1.6e-2
ENGINE_SPLIT_KEYS = (256, 512, 1024, 2048)  # split boundaries the engine could fix (below ctx)
# (block_n, num_warps, num_stages, splits factor over choose_num_splits, prefetch_ids) tried
# by --sweep.
SWEEP = [(bn, 4, st, f, False) for bn in (32, 64, 128) for st in (2, 3, 4) for f in (1, 2)] + [
    (64, 8, 2, 1, False),
    *[(bn, 2, st, f, False) for bn in (32, 64, 128) for st in (2, 3) for f in (1, 2)],
    (64, 1, 2, 1, False),
    *[(bn, 4, st, 1, True) for bn in (64, 128) for st in (2, 3)],
]


def kv_bytes_read(seq_lens: list[int], num_kv_heads: int, head_dim: int, elem_size: int) -> int:
    """Bytes of K and V a decode step must read: every key and value of every request once."""
    return sum(seq_lens) * num_kv_heads * head_dim * 2 * elem_size


def _inputs(batch: int, ctx: int, block_size: int, kv_dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    # kv: [2, NB, BS, Hkv, d], the engine's layout; the kernel reads kv[0] and kv[1] (views).
    kv = torch.randn(
        2, num_blocks, block_size, HKV, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE
    )
    kv = to_kv_cache(kv, kv_dtype)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).cuda()
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)  # [B, max_blocks]
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")  # [B]
    q = torch.randn(batch, HQ, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    return dict(q=q, kv=kv, block_tables=block_tables, seq_lens=seq_lens)


def _gather_sdpa(q, kv, block_tables, seq_lens, scale: float) -> torch.Tensor:
    """The torch backend's decode path: gather whole blocks, one masked SDPA call."""
    batch, width = block_tables.shape
    block_size = kv.shape[2]
    flat = block_tables.flatten().long()
    keys = kv[0].index_select(0, flat).view(batch, -1, HKV, HEAD_DIM).transpose(1, 2)
    vals = kv[1].index_select(0, flat).view(batch, -1, HKV, HEAD_DIM).transpose(1, 2)
    # keys, vals: [B, Hkv, L, d]; q: [B, Hkv, G, d], the G heads of a group as G query rows
    qg = q.view(batch, HKV, HQ // HKV, HEAD_DIM)
    pos = torch.arange(width * block_size, device=q.device)
    mask = (pos[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, scale=scale)
    return out.reshape(batch, HQ, HEAD_DIM)


def _row(shape: str, ms: float, nbytes: int, **extra) -> dict:
    tbps = nbytes / (ms * 1e-3) / 1e12
    return {
        "kernel": "decode",
        "shape": shape,
        "ms": ms,
        "tbps": tbps,
        "ceiling_tbps": CEILING_TBPS,
        "pct_of_ceiling": 100.0 * tbps / CEILING_TBPS,
        **extra,
    }


def _bench_shape(
    batch: int, ctx: int, block_size: int, num_sms: int, sweep: bool, kv_dtype: torch.dtype
) -> list[dict]:
    scale = HEAD_DIM**-0.5
    elem = torch.tensor([], dtype=kv_dtype).element_size()
    nbytes = kv_bytes_read([ctx] * batch, HKV, HEAD_DIM, elem)
    name = "fp8" if kv_dtype == FP8_KV else "bf16"
    shape = f"B={batch} ctx={ctx} bs={block_size} Hq={HQ} Hkv={HKV} d={HEAD_DIM} {name}"
    if nbytes > MAX_KV_BYTES:
        print(f"skip {shape}: K+V {nbytes / 1e9:.0f} GB > {MAX_KV_BYTES / 1e9:.0f} GB")
        return []
    x = _inputs(batch, ctx, block_size, kv_dtype)
    q, kv, bt, seq = x["q"], x["kv"], x["block_tables"], x["seq_lens"]
    splits = choose_num_splits(batch, HKV, ctx, num_sms)
    out = torch.empty_like(q)
    # Two rows through the fp32 reference: a check for every variant that costs no memory.
    ref2 = paged_decode_attention_ref(q[:2], kv[0], kv[1], bt[:2], seq[:2], scale).float()

    def kernel(
        num_splits: int, block_n: int | None = None, warps: int | None = None, stages: int = 2,
        prefetch: bool = False, split_keys: int | None = None,
    ):  # fmt: skip
        ws = DecodeWorkspace.allocate(batch, HQ, num_splits, HEAD_DIM, q.device)
        return lambda: paged_decode_attention(
            q, kv[0], kv[1], bt, seq, scale, num_splits, out, ws,
            block_n=block_n, num_warps=warps, num_stages=stages, prefetch_ids=prefetch,
            split_keys=split_keys,
        )  # fmt: skip

    def measure(
        num_splits: int, block_n: int | None, warps: int | None, stages: int,
        prefetch: bool = False, split_keys: int | None = None,
    ) -> dict | None:  # fmt: skip
        fn = kernel(num_splits, block_n, warps, stages, prefetch, split_keys)
        out.fill_(float("nan"))  # a variant that writes nothing must not pass on stale output
        try:
            fn()
        except OutOfResources as e:  # e.g. block_n 128 x 4 stages: past shared memory
            print(f"{shape} S={num_splits} bn={block_n} w={warps} st={stages}: {e}")
            return None
        ok = torch.allclose(out[:2].float(), ref2, atol=ATOL, rtol=RTOL)
        config = dict(
            num_splits=num_splits, block_n=block_n, num_warps=warps, num_stages=stages,
            prefetch_ids=prefetch, split_keys=split_keys,
        )  # fmt: skip
        return _row(shape, time_ms(fn), nbytes, correct=ok, **config)

    row = measure(splits, None, None, 2)  # the wrapper's defaults
    assert row is not None
    if kv_dtype == FP8_KV:
        # The peer: the same kernel, defaults and splits on a bf16 cache of the same values.
        kv16 = kv.to(DTYPE)
        ws = DecodeWorkspace.allocate(batch, HQ, splits, HEAD_DIM, q.device)
        row["peer"] = "same kernel, bf16 cache"
        row["peer_ms"] = time_ms(
            lambda: paged_decode_attention(q, kv16[0], kv16[1], bt, seq, scale, splits, out, ws)
        )
        row["bf16_over_fp8"] = row["peer_ms"] / row["ms"]
        del kv16
    else:
        row.update(_peer_row(q, kv, bt, seq, scale, out))
        row["correct"] = row["correct"] and row.pop("peer_ok", True)
    torch.cuda.empty_cache()
    rows = [row]
    print(_fmt(row), flush=True)
    variants = []
    # The engine's splits: fixed boundaries every split_keys keys (TritonBackend), for
    # batch-invariant results, a merge whenever S > 1.
    variants += [(-(-ctx // keys), None, None, 2, False, keys) for keys in ENGINE_SPLIT_KEYS
                 if keys < ctx]  # fmt: skip
    if sweep and ctx >= 4096:
        variants += [(min(splits * factor, MAX_SPLITS), bn, warps, stages, prefetch, None)
                     for bn, warps, stages, factor, prefetch in SWEEP]  # fmt: skip
    for config in variants:
        variant = measure(*config)
        if variant is not None:
            rows.append({**variant, "variant": True})
            print(_fmt(rows[-1]), flush=True)
    return rows


def _peer_row(q, kv, bt, seq, scale: float, out: torch.Tensor) -> dict:
    """The gather + SDPA peer on the whole batch (and the kernel's output checked against
    it), if it fits."""
    try:
        peer = _gather_sdpa(q, kv, bt, seq, scale).float()
        err = (out.float() - peer).abs().max().item()
        ok = torch.allclose(out.float(), peer, atol=ATOL, rtol=RTOL)
        del peer
        ms = time_ms(lambda: _gather_sdpa(q, kv, bt, seq, scale))
        return {"max_abs_err_vs_peer": err, "peer": "gather+sdpa", "peer_ms": ms, "peer_ok": ok}
    except Exception as e:  # out of memory, or no SDPA kernel for it: keep the kernel's row
        return {"peer": f"gather+sdpa failed: {type(e).__name__}: {e}"[:200], "peer_ms": None}


def _fmt(r: dict) -> str:
    peer = f"  peer {r['peer_ms']:.3f} ms" if r.get("peer_ms") else ""
    cfg = f"S={r['num_splits']} bn={r['block_n'] or 'def'} w={r['num_warps'] or 'def'}"
    cfg += f" st={r['num_stages']}" + (" pf" if r.get("prefetch_ids") else "")
    cfg += f" keys={r['split_keys']}" if r.get("split_keys") else ""
    ok = "ok" if r["correct"] else "WRONG"
    return (
        f"{r['shape']:<48} {cfg:<24} {r['ms']:8.3f} ms {r['tbps']:5.2f} TB/s "
        f"{r['pct_of_ceiling']:5.1f}% {ok}{peer}"
    )


def benchmark(
    sweep: bool = False,
    kv_dtype: torch.dtype = DTYPE,
    batches=BATCHES,
    contexts=CONTEXTS,
    block_sizes=BLOCK_SIZES,
) -> list[dict]:
    """One row per shape at the default config (with the peer's time), and with ``sweep`` one
    per tuning variant on the 4k and 16k shapes (marked ``variant``)."""
    if not torch.cuda.is_available():
        raise RuntimeError("kernel_bench_decode needs a CUDA GPU")
    warm_up_gpu()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict] = []
    for block_size in block_sizes:
        for batch in batches:
            for ctx in contexts:
                rows += _bench_shape(batch, ctx, block_size, num_sms, sweep, kv_dtype)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time tuning variants")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default $OUT)")
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    args = parser.parse_args()
    print(torch.cuda.get_device_name(0), "torch", torch.__version__)

    def ints(text: str) -> list[int]:
        return [int(v) for v in text.split(",")]

    rows = benchmark(
        sweep=args.sweep,
        kv_dtype=FP8_KV if args.kv_dtype == "fp8" else DTYPE,
        batches=ints(args.batches),
        contexts=ints(args.contexts),
        block_sizes=ints(args.block_sizes),
    )
    print("\nbest per shape:")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        good = [r for r in rows if r["shape"] == shape and r["correct"]]
        print(_fmt(min(good, key=lambda r: r["ms"])) if good else f"{shape}: no correct run")
    path = args.out or (
        Path(os.environ["OUT"]) / "kernel_bench_decode.json" if "OUT" in os.environ else None
    )
    if path is not None:
        path.write_text(json.dumps(rows, indent=1))
        print("wrote", path)


if __name__ == "__main__":
    main()
