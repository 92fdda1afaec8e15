"""GPU engine throughput: tokenmill against HF transformers `generate` and the roofline.

Random weights of real shapes (load_format=random), fixed output lengths (EOS ignored), all
requests submitted at once; output tokens / wall time of the whole batch (model load and
CUDA-graph capture excluded). Workloads:

  llama8b  Llama-3-8B shape, bf16, N requests of 1000 input and 1000 output tokens
           (N = 1024 by default; --llama-requests to scale it down).
  qwen3    the nano-vllm benchmark: Qwen3-0.6B shape, 256 requests, input and output lengths
           each uniform in [100, 1024] (seed 0).
  prefix   Llama-3-8B shape, 512 requests: one 2,000-token system prompt + a unique 50-token
           question each, 100 output tokens; prefix caching on and off.

Peer: HF transformers `generate` (static batches, same random-weight shapes, bf16, SDPA) on
a subset (one batch of --hf-batch requests; --hf-out output tokens), in the same run.
Roofline: for every decode step the engine ran, (weight bytes + KV bytes read) / 4.25 TB/s
against FLOPs / 795 TFLOP/s, whichever is larger; the sum over steps gives a lower bound on
decode time and so an upper bound on output tokens/s; ``steps_against_bound`` splits the
run's GPU time and that bound by kind of step and batch size.

    PYTHONPATH=$PWD python3 bench/throughput.py [--workloads llama8b,qwen3,prefix]
        [--quantization fp8|int4|int8] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenmill import LLM, SamplingParams  # noqa: E402

HBM_BPS = 4.25e12
PEAK_FLOPS = 795e12

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def model_dir(cfg: dict, root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def param_bytes(cfg: dict) -> int:
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    head = 0 if cfg["tie_word_embeddings"] else cfg["vocab_size"] * h
    return 2 * (n * per_layer + cfg["vocab_size"] * h + head + h)


def step_bound_seconds(cfg: dict, record) -> float:
    """Lower bound on one step's GPU time: a decode step reads the weights and its batch's KV
    (bytes / 4.25 TB/s) or does its matmul FLOPs (/ 795 TFLOP/s), whichever is longer; other
    steps are counted by their matmul FLOPs alone (attention FLOPs left out: a lower bound)."""
    d = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * d * 2
    weights = param_bytes(cfg)
    t_flop = record.num_tokens * weights / PEAK_FLOPS  # 2 FLOPs per bf16 parameter (2 bytes)
    if record.num_tokens == record.num_reqs:
        return max((weights + record.context_tokens * kv_per_token) / HBM_BPS, t_flop)
    return t_flop


def roofline_seconds(cfg: dict, records) -> float:
    """Lower bound on the run's time: the sum of its steps' bounds."""
    return sum(step_bound_seconds(cfg, r) for r in records)


def steps_against_bound(cfg: dict, records) -> dict[str, list]:
    """Where the run's GPU time went against the roofline, by kind of step and batch size
    (the largest power of two at or below a step's rows): per bucket [steps, GPU ms, bound
    ms, host ms] summed, so the buckets that lose the most to their bound stand out."""
    table: dict[str, list] = {}
    for r in records:
        bucket = f"{'decode' if r.decode else 'mixed'} {1 << (max(r.num_reqs, 1).bit_length() - 1)}"
        row = table.setdefault(bucket, [0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += r.gpu_ms or 0.0
        row[2] += step_bound_seconds(cfg, r) * 1e3
        row[3] += r.cpu_ms
    return {k: [v[0], *(round(x, 1) for x in v[1:])] for k, v in sorted(table.items())}


def run_tokenmill(cfg: dict, path: Path, prompts, out_lens, **engine_settings):
    """``engine_settings``: EngineConfig fields over its defaults (max_num_seqs, ...)."""
    llm = LLM(
        str(path),
        load_format="random",
        dtype="bfloat16",
        device="cuda",
        profile_steps=True,
        **engine_settings,
    )
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in out_lens]
    # Warm-up on prompts shaped like the workload's (compiles every kernel specialization it
    # will meet) but with other tokens, so the prefix cache holds none of the real prompts.
    warm = [[(t * 7 + 13) % 1000 + 1 for t in p] for p in prompts[:48]]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    llm.engine.runner.profiler.records.clear()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(o.num_completion_tokens for o in outs)
    assert tokens == sum(out_lens), "every request must produce its fixed length"
    recs = llm.engine.runner.profiler.records
    bound = roofline_seconds(cfg, recs)
    profile = llm.engine.step_profile()
    hits = llm.engine.scheduler.kv.prefix_cache_stats
    preemptions = llm.engine.scheduler.stats.num_preemptions
    del llm
    torch.cuda.empty_cache()
    return {
        "seconds": round(elapsed, 2),
        "output_tokens": tokens,
        "tok_per_s": round(tokens / elapsed, 1),
        "step_profile": profile,
        "prefix_hit_rate": round(hits.hit_rate, 3),
        "steps": len(recs),
        "preemptions": preemptions,
        "roofline_tok_per_s": round(tokens / bound, 1) if bound else None,
        "steps_against_bound": steps_against_bound(cfg, recs),
    }


def run_hf(cfg: dict, batch: int, in_len: int, out_len: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[cfg["architectures"][0]]
    hf_cfg = AutoConfig.for_model(model_type, **cfg)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            hf_cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    ids = torch.randint(1000, 30000, (batch, in_len), device="cuda")
    mask = torch.ones_like(ids)
    kwargs = dict(
        max_new_tokens=out_len,
        min_new_tokens=out_len,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch.inference_mode():
        model.generate(
            ids[:2, :16],
            attention_mask=mask[:2, :16],
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - in_len) * batch
    del model
    torch.cuda.empty_cache()
    return {
        "batch": batch,
        "in": in_len,
        "out": out_len,
        "seconds": round(elapsed, 2),
        "output_tokens": tokens,
        "tok_per_s": round(tokens / elapsed, 1),
    }


def random_prompts(rng: np.random.Generator, lens: list[int], vocab: int) -> list[list[int]]:
    return [rng.integers(1000, vocab - 1000, n).tolist() for n in lens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="llama8b,qwen3,prefix")
    parser.add_argument("--llama-requests", type=int, default=1024)
    parser.add_argument("--hf-batch", type=int, default=256)
    parser.add_argument("--hf-out", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="llama8b's batch cap")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF peer runs")
    parser.add_argument(
        "--quantization", default="none", choices=("none", "fp8", "int4", "int8"),
        help="llama8b and qwen3: linear layers in fp8, or GGUF-block int4 (Q4_1's layout) or "
        "int8 (Q8_0's) with random codes (the roofline still counts bf16 bytes)",
    )  # fmt: skip
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    args = parser.parse_args()
    quant = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    print(torch.cuda.get_device_name(0), "torch", torch.__version__, flush=True)
    results: dict = {}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in args.workloads.split(","):
            if name == "llama8b":
                cfg, n = LLAMA_8B, args.llama_requests
                prompts = random_prompts(rng, [1000] * n, cfg["vocab_size"])
                res = run_tokenmill(
                    cfg,
                    model_dir(cfg, root, name),
                    prompts,
                    [1000] * n,
                    max_num_seqs=args.max_num_seqs,
                    **quant,
                )
                res["max_num_seqs"] = args.max_num_seqs
                res.update(quant)
                if not args.no_hf:
                    res["hf"] = run_hf(cfg, args.hf_batch, 1000, args.hf_out)
            elif name == "qwen3":
                cfg = QWEN3_06B
                r = np.random.default_rng(0)
                ins = r.integers(100, 1025, 256).tolist()
                outs = r.integers(100, 1025, 256).tolist()
                prompts = random_prompts(rng, ins, cfg["vocab_size"])
                res = run_tokenmill(cfg, model_dir(cfg, root, name), prompts, outs, **quant)
                res.update(quant)
                if not args.no_hf:
                    res["hf"] = run_hf(cfg, args.hf_batch, 562, args.hf_out)
            else:
                cfg = LLAMA_8B
                system = rng.integers(1000, 100000, 2000).tolist()
                prompts = [system + q for q in random_prompts(rng, [50] * 512, 100000)]
                path = model_dir(cfg, root, name)
                res = {
                    "on": run_tokenmill(
                        cfg, path, prompts, [100] * 512, enable_prefix_caching=True
                    ),
                    "off": run_tokenmill(
                        cfg, path, prompts, [100] * 512, enable_prefix_caching=False
                    ),
                }
                res["speedup"] = round(res["on"]["tok_per_s"] / res["off"]["tok_per_s"], 2)
            results[name] = res
            print(name, json.dumps(res), flush=True)
            if os.environ.get("OUT"):  # after each workload: a timeout keeps what finished
                Path(os.environ["OUT"], "throughput.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
