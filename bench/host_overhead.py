"""Host overhead per engine step at growing batch sizes, with HF `generate` as the peer.

The engine's host work (scheduling, input building, sampling metadata, output processing,
detokenization) grows with the number of running requests; on a small model it, not the
device, bounds throughput. This prints, per ``max_num_seqs``: output tok/s, and the mean host
ms and device ms per decode step (``profile_steps``), then HF `generate` on the same prompts
in static batches of each size, or of ``--peer-batch`` once (EOS ignored on both sides,
greedy).

    PYTHONPATH=. python bench/host_overhead.py --model tiny --device cpu --batches 256,1024
    PYTHONPATH=. python bench/host_overhead.py --model smollm2-135m-instruct --device cuda \
        --batches 256,512,1024 --requests 4096 --max-tokens 128

``--model tiny`` builds a tiny random Llama (2 layers, hidden 64) whose own compute is
negligible, so its step time is almost all host work; prompts are random token ids of
``--prompt-len``. A model alias or path uses chat prompts from bench/prompts.py instead.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine.loader import resolve_model_source  # noqa: E402


def tiny_llama(folder: Path) -> Path:
    """A random tiny Llama saved as an HF directory (safetensors + config + tokenizer)."""
    from tests.tiny_models import save_tiny_model

    return save_tiny_model("llama", folder / "tiny-llama", max_position_embeddings=1024)


def prompts_for(model: str, llm: LLM, count: int, prompt_len: int) -> list[list[int]]:
    if model == "tiny":
        generator = torch.Generator().manual_seed(0)
        vocab = llm.engine.model_config.vocab_size
        ids = torch.randint(3, vocab, (count, prompt_len), generator=generator)
        return ids.tolist()
    from bench.prompts import chat_prompts

    return [llm.encode_chat(c) for c in chat_prompts(count)]


def run_tokenmill(
    llm: LLM, prompts: list[list[int]], max_tokens: int, profile_host: bool = False
) -> tuple[float, int, dict, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # Warm-up on a full batch, so every kernel variant the run's shapes need is compiled
    # before the clock starts (a first run on a fresh machine compiled them inside it); then
    # the prefix cache is emptied, so the run computes its prompts itself.
    warm = prompts[: llm.engine.config.max_num_seqs]
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0))
    if not llm.engine.scheduler.kv.reset_prefix_cache():
        raise RuntimeError("the warm-up left KV blocks held: cannot empty the prefix cache")
    llm.engine.runner.profiler.records.clear()
    host = cProfile.Profile() if profile_host else None
    start = time.perf_counter()
    if host is not None:
        host.enable()
    outs = llm.generate(prompts, params)
    if host is not None:
        host.disable()
    elapsed = time.perf_counter() - start
    if host is not None:
        print_host_profile(host, len(prompts))
    tokens = sum(o.num_completion_tokens for o in outs)
    return elapsed, tokens, llm.engine.step_profile(), [o.token_ids for o in outs]


def print_host_profile(host: cProfile.Profile, requests: int) -> None:
    """The engine's own functions by cumulative time (the main thread's host work; the
    output worker thread is not in it), to stderr."""
    out = io.StringIO()
    stats = pstats.Stats(host, stream=out)
    stats.sort_stats("cumulative").print_stats("tokenmill", 40)
    stats.sort_stats("tottime").print_stats(30)  # every module: torch, Triton, numpy too
    print(f"host profile over {requests} requests:\n{out.getvalue()}", file=sys.stderr)


def run_hf(
    model_dir: Path, prompts: list[list[int]], batch: int, max_tokens: int, device: str
) -> tuple[float, int, list[list[int]]]:
    """HF generate over static batches of ``batch`` prompts (left-padded), greedy."""
    from bench.hf_peer import left_padded, load_hf_model

    model = load_hf_model(model_dir, device)
    pad = 0
    outs: list[list[int]] = []
    tokens = 0
    with torch.inference_mode():
        warm = torch.tensor([prompts[0]], device=device)
        model.generate(warm, max_new_tokens=2, do_sample=False, pad_token_id=pad)
        start = time.perf_counter()
        for at in range(0, len(prompts), batch):
            ids, mask = left_padded(prompts[at : at + batch], pad)
            width = ids.shape[1]
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
            new = out[:, width:]
            tokens += int(new.numel())
            outs.extend(new.tolist())
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return elapsed, tokens, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, or a model alias / path")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="256,1024")
    parser.add_argument("--requests", type=int, default=0, help="default: the largest batch")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-peer", action="store_true", help="skip HF generate")
    parser.add_argument(
        "--kv-cache-memory", type=float, default=None, help="bytes, or a fraction of the GPU"
    )
    parser.add_argument(
        "--peer-batch", type=int, default=0, help="one HF run at this batch (default: each)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--profile-host",
        action="store_true",
        help="run tokenmill under cProfile and print its functions by cumulative time "
        "(slows the host: its tok/s is not comparable to a run without)",
    )
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    count = args.requests or max(batches)

    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_llama(Path(tmp))) if args.model == "tiny" else args.model
        model_path = Path(model) if args.model == "tiny" else resolve_model_source(model).path
        rows = []
        prompts: list[list[int]] = []
        for batch in batches:
            llm = LLM(
                model,
                device=args.device,
                max_num_seqs=batch,
                max_num_batched_tokens=max(8192, batch * args.prompt_len),
                profile_steps=True,
                kv_cache_memory=args.kv_cache_memory,
            )
            prompts = prompts or prompts_for(args.model, llm, count, args.prompt_len)
            seconds, tokens, profile, tm_ids = run_tokenmill(
                llm, prompts, args.max_tokens, args.profile_host
            )
            row = {
                "max_num_seqs": batch,
                "tok_per_s": round(tokens / seconds, 1),
                "host_ms_per_step": profile.get("decode", {}).get("cpu_ms"),
                "gpu_ms_per_step": profile.get("decode", {}).get("gpu_ms"),
                "profile": profile,
            }
            del llm  # free its KV cache before the next engine sizes its own
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if not args.no_peer and not args.peer_batch:
                hf_s, hf_tokens, hf_ids = run_hf(
                    model_path, prompts, batch, args.max_tokens, args.device
                )
                row["hf_tok_per_s"] = round(hf_tokens / hf_s, 1)
                row["ratio"] = round(row["tok_per_s"] / row["hf_tok_per_s"], 2)
                row["identical"] = sum(a == b for a, b in zip(tm_ids, hf_ids, strict=True))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        if not args.no_peer and args.peer_batch:
            hf_s, hf_tokens, _ = run_hf(
                model_path, prompts, args.peer_batch, args.max_tokens, args.device
            )
            peer = {"hf_batch": args.peer_batch, "hf_tok_per_s": round(hf_tokens / hf_s, 1)}
            rows.append(peer)
            print(json.dumps(peer), flush=True)

    result = {
        "model": args.model,
        "device": args.device,
        "requests": count,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
