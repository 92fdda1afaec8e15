"""Decode attention's split geometry at the batch sizes a job's tail runs (GPU).

The engine fixes a request's decode splits (its result then depends on its own length
alone) and used to size them from ``max_model_len``: a Qwen3-0.6B engine (40,960 tokens)
ran every key run under 5,120 as one program per (request, KV head), so at 8 rows the grid
was 64 programs on 132 SMs. ``split_programs`` lets fewer programs than splits share a
request's (small, fixed) splits, each walking a run of them, so the split size can stay
small at any batch without a program per split.

Times, on Qwen3-0.6B's attention shape (16 q / 8 KV heads, d 128, bf16, block_size 16), at
each batch and key-length profile (every row at 1,400 keys, or lengths uniform in
[200, 2048] as mid-run rows of the nano-vllm workload): the engine's geometry before
(5,120-key splits, one program each), the engine's policy now (DECODE_SPLIT_KEYS,
choose_split_programs), and for fixed splits of 256 / 512 / 1,024 keys every program count
1, 2, 4, ... up to the splits. Each call is captured in a CUDA graph (as the engine's decode
steps replay them), L2 flushed before each (``bench.gpu_timing.time_ms``); every variant is
checked against the first of its split size (bit-identical across program counts) and two
rows against the fp32 reference. Prints a table and the fastest variant per case; JSON to --out.

    PYTHONPATH=$PWD python3 bench/decode_split_programs.py [--batches 1,8,64,256] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_timing import time_ms, warm_up_gpu  # noqa: E402
from tokenmill.engine.attention.triton_backend import DECODE_SPLIT_KEYS  # noqa: E402
from tokenmill.kernels.paged_decode_attention import (  # noqa: E402
    DecodeWorkspace,
    choose_split_programs,
    fixed_split_count,
    paged_decode_attention,
    paged_decode_attention_ref,
)

HQ, HKV, HEAD_DIM, BLOCK_SIZE, DTYPE = 16, 8, 128, 16, torch.bfloat16
MAX_MODEL_LEN = 40960  # Qwen3-0.6B's context, the nano-vllm workload engine's
BATCHES = (1, 4, 8, 16, 32, 64, 128, 256)
SPLIT_KEYS = (256, 512, 1024)
CEILING_TBPS = 4.25  # H200 device-to-device copy (BENCHMARKS.md)


def _lengths(profile: str, batch: int, gen: torch.Generator) -> list[int]:
    if profile == "1400":
        return [1400] * batch
    return torch.randint(200, 2049, (batch,), generator=gen).tolist()


def _case(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // BLOCK_SIZE) for n in lengths]
    width = max(need)
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed))
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used : used + n]
        used += n
    kv = torch.randn(2, sum(need), BLOCK_SIZE, HKV, HEAD_DIM, generator=gen, device="cuda")
    q = torch.randn(len(lengths), HQ, HEAD_DIM, generator=gen, device="cuda")
    seq = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return q.to(DTYPE), kv.to(DTYPE), tables.cuda(), seq


def bench_case(batch: int, profile: str) -> list[dict]:
    lengths = _lengths(profile, batch, torch.Generator().manual_seed(batch))
    q, kv, bt, seq = _case(lengths)
    scale = HEAD_DIM**-0.5
    nbytes = sum(lengths) * HKV * HEAD_DIM * 2 * 2
    ref = paged_decode_attention_ref(q[:2], kv[0], kv[1], bt[:2], seq[:2], scale).float()
    old_keys = max(1024, -(-MAX_MODEL_LEN // 8))  # the engine's splits before 446bf1e
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = fixed_split_count(max(lengths), DECODE_SPLIT_KEYS)
    chosen = choose_split_programs(batch, HKV, splits, sms)
    variants = [("engine before", old_keys, None), ("engine policy", DECODE_SPLIT_KEYS, chosen)]
    for keys in SPLIT_KEYS:
        splits = fixed_split_count(max(lengths), keys)
        programs = sorted({min(1 << i, splits) for i in range(7)})
        variants += [(f"keys {keys} P {p}", keys, p) for p in programs]
    rows, firsts = [], {}
    for name, keys, programs in variants:
        splits = fixed_split_count(max(lengths), keys)
        out = torch.full_like(q, float("nan"))
        ws = DecodeWorkspace.allocate(batch, HQ, splits, HEAD_DIM, q.device) if splits > 1 else None

        def call(keys=keys, splits=splits, programs=programs, out=out, ws=ws) -> None:
            paged_decode_attention(
                q, kv[0], kv[1], bt, seq, scale, splits, out, ws, split_keys=keys,
                split_programs=programs,
            )  # fmt: skip

        ms = time_ms(call, graph=True)
        first = firsts.setdefault(keys, out.clone())
        row = {
            "batch": batch,
            "lengths": profile,
            "variant": name,
            "split_keys": keys,
            "splits": splits,
            "programs": programs or splits,
            "ms": round(ms, 4),
            "tbps": round(nbytes / (ms * 1e-3) / 1e12, 3),
            "same_bits_as_P1": torch.equal(out, first),
            "close_to_ref": torch.allclose(out[:2].float(), ref, atol=1.6e-2, rtol=1.6e-2),
        }
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--profiles", default="1400,uniform")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_split_programs needs a CUDA GPU")
    warm_up_gpu()
    rows = []
    print(f"{'batch':>5} {'lengths':>8} {'variant':<18} {'S':>3} {'P':>3} {'ms':>8} {'TB/s':>6}")
    for profile in args.profiles.split(","):
        for batch in map(int, args.batches.split(",")):
            case = bench_case(batch, profile)
            for r in case:
                flag = "" if r["same_bits_as_P1"] and r["close_to_ref"] else "  WRONG"
                print(
                    f"{r['batch']:>5} {r['lengths']:>8} {r['variant']:<18} {r['splits']:>3} "
                    f"{r['programs']:>3} {r['ms']:8.4f} {r['tbps']:6.2f}{flag}",
                    flush=True,
                )
            best = min(case, key=lambda r: r["ms"])
            now = case[0]["ms"]
            policy = case[1]["ms"]
            print(
                f"  fastest: {best['variant']} ({now / best['ms']:.2f}x the engine before); "
                f"the policy {now / policy:.2f}x"
            )
            rows += case
    out = args.out or (Path(os.environ["OUT"]) / "decode_split_programs.json")
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
