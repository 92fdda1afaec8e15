"""Memory bandwidth of the element-wise kernels (RMSNorm + residual, RoPE, SiLU-and-mul).

Each case checks the kernel against its torch reference first, then times both with
``bench.gpu_timing.time_ms`` (median; L2 flushed clean before each call) and reports the
bytes the op must move (reads + writes) over the kernel's time, against the device-to-device
copy ceiling of the H200 (4.25 TB/s, measured: BENCHMARKS.md) and against a copy of the same
bytes timed in the same run (``%copy``: at T=4096 the ops move 80-350 MB, where a copy's
own launch and tail cost shows). Shapes are Llama-3-8B's, bf16:

    rms_norm + residual  T=4096/16384, H=4096          reads x, residual, w; writes residual, y
    rope_ (in place)     T=4096/16384, 32/8 heads, d 128   reads+writes q, k; reads positions
                                                        and one cos and one sin row a token
    silu_and_mul         T=4096/16384, I=14336          reads [T, 2I]; writes [T, I]

    PYTHONPATH=$PWD python3 bench/kernel_bench_elementwise.py [--sweep] [--json PATH]

``--sweep`` also times other launch configurations (num_warps, rows or tokens per program) of
the same cases, each row tagged with its configuration (the default rope_ row is tagged with
the one ``_launch_config`` picked). Results are printed as a table; the JSON (default
$OUT/kernel_bench_elementwise.json when $OUT is set) holds every row plus the device and
versions.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_timing import time_ms, warm_up_gpu  # noqa: E402
from tokenmill.engine.model_config import ModelConfig  # noqa: E402
from tokenmill.engine.models.rope import RotaryEmbedding  # noqa: E402
from tokenmill.kernels import rms_norm as rms_norm_mod  # noqa: E402
from tokenmill.kernels import rope as rope_mod  # noqa: E402
from tokenmill.kernels import silu_and_mul as silu_mod  # noqa: E402
from tokenmill.kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402
from tokenmill.kernels.rope import rope_, rope_ref  # noqa: E402
from tokenmill.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref  # noqa: E402

__all__ = ["benchmark", "sweep", "CEILING_TBPS"]

CEILING_TBPS = 4.25  # H200 device-to-device copy, measured (GPU.md)
TOKENS = (4096, 16384)
HIDDEN, INTER, N_HEADS, N_KV, HEAD_DIM = 4096, 14336, 32, 8, 128
MAX_POSITIONS = 131072
EPS = 1e-5
DTYPE = torch.bfloat16
# bf16 against the references: the kernels round once from fp32 like them, so 2 ulps
# (2^-7 relative each) cover summation-order and FMA differences.
TOL = dict(rtol=1.6e-2, atol=1.6e-2)


# -- bytes each op must move ----------------------------------------------------------------


def rms_norm_bytes(t: int, h: int, elem: int) -> int:
    """Reads x, residual [T, H] and w [H]; writes residual (= s) and y [T, H]."""
    return (4 * t * h + h) * elem


def rope_bytes(t: int, hq: int, hkv: int, d: int, elem: int) -> int:
    """Reads and writes q, k [T, H*, d]; reads positions [T] int64 and a cos and a sin row
    [d/2] fp32 per token (distinct positions, as in prefill)."""
    return 2 * t * (hq + hkv) * d * elem + t * 8 + 2 * t * (d // 2) * 4


def silu_and_mul_bytes(t: int, inter: int, elem: int) -> int:
    """Reads x [T, 2I]; writes y [T, I]."""
    return 3 * t * inter * elem


# -- one case -------------------------------------------------------------------------------


@functools.cache
def _copy_ms(nbytes: int) -> float:
    """A device-to-device copy moving ``nbytes`` (half read, half written): the ceiling at
    this transfer size, where fixed launch and tail costs weigh more than in GPU.md's."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src))


def _row(kernel: str, shape: str, ms: float, nbytes: int, torch_ms: float | None) -> dict:
    tbps = nbytes / (ms * 1e-3) / 1e12
    copy_ms = _copy_ms(nbytes)
    return {
        "copy_ms": round(copy_ms, 4),
        "pct_of_same_size_copy": round(100 * copy_ms / ms, 1),
        "kernel": kernel,
        "shape": shape,
        "ms": round(ms, 4),
        "tbps": round(tbps, 3),
        "ceiling_tbps": CEILING_TBPS,
        "pct_of_ceiling": round(100 * tbps / CEILING_TBPS, 1),
        "torch_ms": None if torch_ms is None else round(torch_ms, 4),
        "bytes": nbytes,
    }


def _rms_norm_case(t: int, with_torch: bool = True, tag: str = "") -> dict:
    gen = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, HIDDEN, device="cuda", dtype=DTYPE, generator=gen)  # [T, H]
    residual = torch.randn(t, HIDDEN, device="cuda", dtype=DTYPE, generator=gen)
    weight = 1 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=DTYPE, generator=gen)

    y_ref, s_ref = rms_norm_ref(x, weight, EPS, residual)
    y, s = rms_norm(x, weight, EPS, residual.clone())
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)  # fp32 add, one rounding: exact

    # Timed in place: the residual keeps accumulating x, harmless for bandwidth.
    ms = time_ms(lambda: rms_norm(x, weight, EPS, residual))
    torch_ms = time_ms(lambda: rms_norm_ref(x, weight, EPS, residual)) if with_torch else None
    nbytes = rms_norm_bytes(t, HIDDEN, x.element_size())
    return _row("rms_norm+residual" + tag, f"T={t} H={HIDDEN} bf16", ms, nbytes, torch_ms)


def _rope_tables() -> tuple[torch.Tensor, torch.Tensor]:
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=32,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV,
        head_dim=HEAD_DIM,
        rms_norm_eps=EPS,
        rope_theta=500000.0,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    rope = RotaryEmbedding(config, MAX_POSITIONS)  # the engine's tables
    return rope.cos.cuda(), rope.sin.cuda()  # [P, d/2] fp32 each


def _rope_case(t: int, with_torch: bool = True, tag: str = "") -> dict:
    cos, sin = _rope_tables()
    gen = torch.Generator(device="cuda").manual_seed(t)
    hq, hkv = N_HEADS, N_KV
    qkv = torch.randn(t, hq + 2 * hkv, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    positions = torch.randperm(MAX_POSITIONS, device="cuda", generator=gen)[:t]  # distinct
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]  # strided views of the fused qkv output

    q_ref, k_ref = rope_ref(q, k, positions, cos, sin)
    check = qkv.clone()
    rope_(check[:, :hq], check[:, hq : hq + hkv], positions, cos, sin)
    torch.testing.assert_close(check[:, :hq], q_ref, **TOL)
    torch.testing.assert_close(check[:, hq : hq + hkv], k_ref, **TOL)

    ms = time_ms(lambda: rope_(q, k, positions, cos, sin))  # rotates qkv again each call
    torch_ms = time_ms(lambda: rope_ref(q, k, positions, cos, sin)) if with_torch else None
    nbytes = rope_bytes(t, hq, hkv, HEAD_DIM, qkv.element_size())
    shape = f"T={t} Hq={hq} Hkv={hkv} d={HEAD_DIM} bf16"
    return _row("rope_" + tag, shape, ms, nbytes, torch_ms)


def _silu_case(t: int, with_torch: bool = True, tag: str = "") -> dict:
    gen = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, 2 * INTER, device="cuda", dtype=DTYPE, generator=gen)  # [T, 2I]
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOL)
    ms = time_ms(lambda: silu_and_mul(x))
    torch_ms = time_ms(lambda: silu_and_mul_ref(x)) if with_torch else None
    nbytes = silu_and_mul_bytes(t, INTER, x.element_size())
    return _row("silu_and_mul" + tag, f"T={t} I={INTER} bf16", ms, nbytes, torch_ms)


def benchmark() -> list[dict]:
    """Every kernel at every size with the default launch configuration; needs CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("kernel_bench_elementwise needs a CUDA GPU")
    warm_up_gpu()
    rows = []
    for t in TOKENS:
        rows.append(_rms_norm_case(t))
        tokens_pp, warps = rope_mod._launch_config(N_HEADS, N_KV, HEAD_DIM)
        rows.append(_rope_case(t, tag=f" [default tokens={tokens_pp} warps={warps}]"))
        rows.append(_silu_case(t))
    return rows


# -- launch-configuration sweep ---------------------------------------------------------------

# rope_ (tokens per program, num_warps): 10-80 fp32 q + k tile elements a thread at Llama-3-8B
# shapes. Denser variants (4 tokens / 4 warps, 8 / 8) spill registers on sm_90 (ptxas -v)
# and are left out.
ROPE_SWEEP = (
    (1, 2), (1, 4), (1, 8), (1, 16),
    (2, 4), (2, 8), (2, 16),
    (4, 8), (4, 16),
    (8, 16),
)  # fmt: skip


@contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def sweep() -> list[dict]:
    """The same cases under other launch configurations (kernel name tagged with them)."""
    rows = []
    for t in TOKENS:
        for rows_pp, warps in ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16)):
            cfg = (triton.next_power_of_2(HIDDEN), rows_pp, warps)
            with _patched(rms_norm_mod, "_launch_config", lambda h, cfg=cfg: cfg):
                rows.append(_rms_norm_case(t, False, f" [rows={rows_pp} warps={warps}]"))
        for tokens_pp, warps in ROPE_SWEEP:
            cfg = (tokens_pp, warps)
            with _patched(rope_mod, "_launch_config", lambda *_, cfg=cfg: cfg):
                rows.append(_rope_case(t, False, f" [tokens={tokens_pp} warps={warps}]"))
        for block, warps in ((512, 2), (1024, 4), (1024, 8), (2048, 8), (2048, 16)):
            with _patched(silu_mod, "_launch_config", lambda i, c=(block, warps): c):
                rows.append(_silu_case(t, False, f" [block={block} warps={warps}]"))
    return rows


def _table(rows: list[dict]) -> str:
    head = (
        f"{'kernel':<38} {'shape':<34} {'ms':>8} {'TB/s':>6} {'%ceil':>6} {'%copy':>6} "
        f"{'torch ms':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        torch_ms = "" if r["torch_ms"] is None else f"{r['torch_ms']:.4f}"
        lines.append(
            f"{r['kernel']:<38} {r['shape']:<34} {r['ms']:>8.4f} {r['tbps']:>6.2f} "
            f"{r['pct_of_ceiling']:>6.1f} {r['pct_of_same_size_copy']:>6.1f} {torch_ms:>9}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other launch configs")
    parser.add_argument("--json", type=Path, default=None, help="where to write the results")
    args = parser.parse_args()

    rows = benchmark()
    swept = sweep() if args.sweep else []
    print(_table(rows))
    if swept:
        print()
        print(_table(swept))
    out = args.json
    if out is None and os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "kernel_bench_elementwise.json"
    if out is not None:
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "timer": "bench.gpu_timing.time_ms median (warmup 25 ms, rep 100 ms, read-flushed L2)",
        }
        out.write_text(json.dumps({"meta": meta, "rows": rows, "sweep": swept}, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
