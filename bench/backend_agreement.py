"""How often greedy continuations agree across attention backends and dtypes (SmolLM2, GPU).

Pairs: triton-bf16 vs torch-bf16 (the kernels' effect; also with CUDA graphs off, whose
padded batches can change cuBLAS's choice of GEMM kernel), torch-bf16 vs torch-fp32 and
triton-bf16 vs torch-fp32 (bf16's own effect), triton-fp32 vs torch-fp32 (must be equal).
Prints identical continuations and the mean position of the first differing token.

    SMOLLM2_GGUF=/path/model.gguf PYTHONPATH=$PWD python3 bench/backend_agreement.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prompts import chat_prompts  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402


def first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else len(a)


def main() -> None:
    model = os.environ.get("SMOLLM2_GGUF", "smollm2-135m-instruct")
    prompts = chat_prompts(int(os.environ.get("PROMPTS", "32")), seed=1)
    greedy = SamplingParams(max_tokens=48, temperature=0)
    runs = {}
    variants = [
        ("torch", "float32", True),
        ("triton", "float32", True),
        ("torch", "bfloat16", True),
        ("triton", "bfloat16", True),
        ("triton-eager", "bfloat16", False),
    ]
    for name, dtype, graphs in variants:
        backend = name.split("-")[0]
        llm = LLM(model, device="cuda", dtype=dtype, attention_backend=backend, cuda_graphs=graphs)
        runs[name, dtype] = [o.token_ids for o in llm.chat(prompts, greedy)]
        del llm
        torch.cuda.empty_cache()
    pairs = [
        (("triton", "float32"), ("torch", "float32")),
        (("triton", "bfloat16"), ("torch", "bfloat16")),
        (("triton-eager", "bfloat16"), ("torch", "bfloat16")),
        (("torch", "bfloat16"), ("torch", "float32")),
        (("triton", "bfloat16"), ("torch", "float32")),
    ]
    for a, b in pairs:
        diffs = [first_diff(x, y) for x, y in zip(runs[a], runs[b], strict=True)]
        same = sum(x == y for x, y in zip(runs[a], runs[b], strict=True))
        print(
            f"{'-'.join(a):>16} vs {'-'.join(b):<16} identical {same}/{len(prompts)}  "
            f"mean first difference at token {sum(diffs) / len(diffs):.1f}"
        )


if __name__ == "__main__":
    main()
