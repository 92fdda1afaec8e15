"""CPU throughput: tokenmill against HF transformers `generate`, same prompts, same run.

SmolLM2-135M-Instruct (the embedded GGUF), fp32 on CPU, 64 chat prompts, 64 new tokens each
(EOS ignored so both do the same work), greedy. HF runs one padded batch of all prompts
(left padding, SDPA attention): its best offline setting. Times exclude model loading.

    .venv/bin/python bench/cpu_throughput.py [--prompts 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prompts import chat_prompts  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.engine.loader import resolve_model_source  # noqa: E402


def run_tokenmill(convs, max_tokens: int, dtype: str) -> tuple[float, int, list[list[int]]]:
    llm = LLM("smollm2-135m-instruct", device="cpu", dtype=dtype)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.chat(convs[:2], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(o.num_completion_tokens for o in outs), [o.token_ids for o in outs]


def run_hf(convs, max_tokens: int, dtype: str) -> tuple[float, int, list[list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_source("smollm2-135m-instruct").path
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )
    with torch.inference_mode():
        model.generate(
            **tok(texts[:2], return_tensors="pt", padding=True, add_special_tokens=False),
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )  # warm-up
        start = time.perf_counter()
        out = model.generate(**batch, **kwargs)
        elapsed = time.perf_counter() - start
    new = out[:, batch["input_ids"].shape[1] :]
    return elapsed, int(new.numel()), new.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", type=Path, help="also write results here")
    args = parser.parse_args()
    convs = chat_prompts(args.prompts)

    tm_time, tm_tokens, tm_ids = run_tokenmill(convs, args.max_tokens, args.dtype)
    hf_time, hf_tokens, hf_ids = run_hf(convs, args.max_tokens, args.dtype)
    same = sum(a == b for a, b in zip(tm_ids, hf_ids, strict=True))
    tm_tps, hf_tps = tm_tokens / tm_time, hf_tokens / hf_time
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch_threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "tokenmill": {
            "seconds": round(tm_time, 2),
            "tokens": tm_tokens,
            "tok_per_s": round(tm_tps, 1),
        },
        "hf_generate": {
            "seconds": round(hf_time, 2),
            "tokens": hf_tokens,
            "tok_per_s": round(hf_tps, 1),
        },
        "ratio": round(tm_tps / hf_tps, 2),
        "identical_continuations": f"{same}/{args.prompts}",
    }
    print(f"tokenmill    {tm_tps:8.1f} tok/s  ({tm_tokens} tokens in {tm_time:.2f}s)")
    print(f"HF generate  {hf_tps:8.1f} tok/s  ({hf_tokens} tokens in {hf_time:.2f}s)")
    print(
        f"ratio        {tm_tps / hf_tps:8.2f}x   "
        f"identical greedy continuations: {same}/{args.prompts}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
