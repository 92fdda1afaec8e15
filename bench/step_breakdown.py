"""Where a GPU engine step's time goes: CUDA time per kernel of decode and mixed steps.

Random weights of a real shape (the shapes of bench/throughput.py). ``--batch`` requests of
``--prompt-len`` tokens are prefilled, then ``--steps`` eager decode steps run under
torch.profiler, then ``--steps`` mixed steps (chunks of new 7,000-token prompts beside the
running decodes). Prints, per step kind, the CUDA milliseconds per step of the busiest
kernels next to the step's roofline (weights + KV bytes / 4.25 TB/s), and writes JSON to $OUT.

    PYTHONPATH=$PWD python3 bench/step_breakdown.py [--models llama8b,qwen3] [--batch 256]
        [--quantization fp8] [--kv-cache-dtype fp8]

With FP8 the roofline counts half of bf16's weight bytes (the embeddings and LM head too,
though they stay bf16: about 1 GB too few on the 8B shape) and 1-byte K/V.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.throughput import HBM_BPS, LLAMA_8B, QWEN3_06B, model_dir, param_bytes  # noqa: E402
from tokenmill import LLM, EngineConfig, SamplingParams  # noqa: E402

# The embedded SmolLM2-135M's shape: a small model, where a step's host work shows most.
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SHAPES = {"llama8b": LLAMA_8B, "qwen3": QWEN3_06B, "smollm2": SMOLLM2_135M}
BUDGET = EngineConfig.max_num_batched_tokens  # tokens a step schedules (the engine default)


def kernel_table(prof, steps: int, top: int) -> list[dict]:
    """Device time per step by kernel: the device's own events only. An operator's device
    time (even its "self" time: on the H100 aten::mm's equalled its cuBLAS kernels') and a
    runtime call's (cuLaunchKernelEx) count kernels again."""
    rows = []
    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CUDA:
            continue
        ms = evt.device_time_total / 1e3 / steps
        if ms > 0:
            rows.append({"kernel": evt.key[:90], "ms_per_step": round(ms, 3), "calls": evt.count})
    rows.sort(key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    for r in rows:
        r["share"] = round(r["ms_per_step"] / total, 3) if total else 0.0
    return rows[:top]


def host_table(prof, steps: int, top: int) -> list[dict]:
    """Host time per step by operator (self time: where the CPU itself spends it)."""
    rows = [
        {
            "op": evt.key[:90],
            "self_cpu_ms_per_step": round(evt.self_cpu_time_total / 1e3 / steps, 3),
        }
        for evt in prof.key_averages()
        if evt.self_cpu_time_total > 0
    ]
    rows.sort(key=lambda r: -r["self_cpu_ms_per_step"])
    return rows[:top]


def profiled_steps(llm: LLM, steps: int, want_mixed: bool):
    engine = llm.engine
    records = engine.runner.profiler.records
    start = len(records)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    check_kinds(records[start:], want_mixed)
    return prof, records[start:]


def check_kinds(records: list, want_mixed: bool) -> None:
    """Every profiled step is of the kind the table names (mixed: new prompts' chunks beside
    the decode batch)."""
    kinds = [r.num_tokens != r.num_reqs for r in records]
    if not all(k == want_mixed for k in kinds):
        raise SystemExit(
            f"step_breakdown: expected only {'mixed' if want_mixed else 'decode'} steps, got "
            f"mixed={kinds}; with more --steps the new prompts may not fit the KV cache beside "
            "the decode batch: lower --steps, --batch or --mixed-prompt-len"
        )


def python_profile(llm: LLM, steps: int, want_mixed: bool, top: int = 25) -> str:
    """``steps`` more steps under cProfile: the Python functions (tokenmill, torch, Triton's
    launcher) by their own time, which torch.profiler's operator table does not show."""
    engine = llm.engine
    records = engine.runner.profiler.records
    start = len(records)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    check_kinds(records[start:], want_mixed)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def breakdown(
    name: str,
    batch: int,
    prompt_len: int,
    steps: int,
    root: Path,
    mixed_len: int,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
) -> dict:
    cfg = SHAPES[name]
    # Long new prompts, chunked by the step budget, keep every profiled step mixed: enough of
    # them to fill the budget of the admission step and of the 2 * steps profiled ones, with
    # room for all of them to run beside the decode batch.
    long_len = min(mixed_len, cfg["max_position_embeddings"] - 200)
    num_long = -(-(2 * steps + 2) * BUDGET // long_len) + 1
    llm = LLM(
        str(model_dir(cfg, root, name)),
        load_format="random",
        dtype="bfloat16",
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        device="cuda",
        max_num_seqs=batch + num_long,
        max_num_batched_tokens=BUDGET,
        cuda_graphs=False,
        async_scheduling=False,
        profile_steps=True,
    )
    engine = llm.engine
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True)
    vocab = cfg["vocab_size"]
    for i in range(batch):
        engine.add_request(f"d{i}", rng.integers(1000, vocab - 1000, prompt_len).tolist(), params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # warm decode steps
        engine.step()
    prof, recs = profiled_steps(llm, steps, want_mixed=False)
    decode_python = python_profile(llm, steps, want_mixed=False)
    d = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    kv_bytes = 1 if kv_cache_dtype == "fp8" else 2
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * d * kv_bytes
    ctx = sum(r.context_tokens for r in recs) / len(recs)
    weight_bytes = param_bytes(cfg) // (2 if quantization == "fp8" else 1)  # see the top
    roof_ms = (weight_bytes + ctx * kv_per_token) / HBM_BPS * 1e3
    decode = {
        "batch": batch,
        "mean_context_tokens": round(ctx / batch, 1),
        "roofline_ms": round(roof_ms, 3),
        "step_gpu_ms": engine.step_profile()["decode"]["gpu_ms"],
        "kernels": kernel_table(prof, steps, 14),
        "python": decode_python,
    }
    engine.runner.profiler.records.clear()
    kv = engine.scheduler.kv
    row_blocks = -(-(prompt_len + 4 * steps + 8) // kv.block_size)  # a decode row's blocks
    room = (kv.num_blocks - batch * row_blocks) * kv.block_size
    need = (2 * steps + 2) * BUDGET  # the new prompts' tokens the mixed steps compute
    if need > room:
        raise SystemExit(
            f"step_breakdown {name}: {steps} mixed steps compute {need} new prompt tokens "
            f"beside the decode batch, but the KV cache has room for about {room}: lower "
            "--steps or --batch"
        )
    for i in range(num_long):
        engine.add_request(f"p{i}", rng.integers(1000, vocab - 1000, long_len).tolist(), params)
    engine.step()  # the first mixed step (admission)
    prof, recs = profiled_steps(llm, steps, want_mixed=True)
    mixed_python = python_profile(llm, steps, want_mixed=True)
    mixed = {
        "mean_tokens": round(sum(r.num_tokens for r in recs) / len(recs), 1),
        "step_gpu_ms": engine.step_profile()["prefill_or_mixed"]["gpu_ms"],
        "flop_bound_ms": round(
            sum(r.num_tokens for r in recs) / len(recs) * param_bytes(cfg) / 795e12 * 1e3, 3
        ),
        "kernels": kernel_table(prof, steps, 14),
        "host": host_table(prof, steps, 25),
        "host_ms_per_step": round(sum(r.cpu_ms for r in recs) / len(recs), 3),
        "python": mixed_python,
    }
    del llm, engine
    torch.cuda.empty_cache()
    return {"decode": decode, "mixed": mixed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama8b,qwen3")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--mixed-prompt-len", type=int, default=7000, help="new prompts of the mixed steps"
    )
    parser.add_argument("--quantization", default="none", choices=("none", "fp8"))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    args = parser.parse_args()
    print(torch.cuda.get_device_name(0), "torch", torch.__version__, flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            res = breakdown(
                name, args.batch, args.prompt_len, args.steps, Path(tmp), args.mixed_prompt_len,
                args.quantization, args.kv_cache_dtype,
            )  # fmt: skip
            results[name] = res
            for kind in ("decode", "mixed"):
                r = res[kind]
                head = {k: v for k, v in r.items() if k not in ("kernels", "host", "python")}
                print(f"\n{name} {kind}: {json.dumps(head)}")
                for k in r["kernels"]:
                    print(f"  {k['ms_per_step']:9.3f} ms {k['share']:6.1%} x{k['calls']:<5} "
                          f"{k['kernel']}")  # fmt: skip
                for h in r.get("host", []):
                    print(f"  host {h['self_cpu_ms_per_step']:9.3f} ms  {h['op']}")
                print(r["python"])
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "step_breakdown.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
