"""How often greedy continuations agree across attention backends and dtypes (SmolLM2, GPU).

Pairs: triton-bf16 vs torch-bf16 (the kernels' effect; also with CUDA graphs off, whose
padded batches can change cuBLAS's choice of GEMM kernel), torch-bf16 vs torch-fp32 and
triton-bf16 vs torch-fp32 (bf16's own effect), triton-fp32 vs torch-fp32 (must be equal).
As a yardstick for the first pair, the torch backend also runs with torch's other SDPA
kernels (memory-efficient, and math), each compared with torch-bf16 on its default kernels:
two correct attention implementations that sum in different orders. Prints identical
continuations and the mean position of the first differing token.

    SMOLLM2_GGUF=/path/model.gguf PYTHONPATH=$PWD python3 bench/backend_agreement.py
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

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
    # (name, dtype, CUDA graphs, SDPA kernels the torch backend may use; None = torch's choice)
    variants = [
        ("torch", "float32", True, None),
        ("triton", "float32", True, None),
        ("torch", "bfloat16", True, None),
        ("triton", "bfloat16", True, None),
        ("triton-eager", "bfloat16", False, None),
        ("torch-efficient", "bfloat16", True, [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
        ("torch-math", "bfloat16", True, [SDPBackend.MATH]),
    ]
    for name, dtype, graphs, sdpa in variants:
        backend = name.split("-")[0]
        with sdpa_kernel(sdpa) if sdpa else contextlib.nullcontext():
            llm = LLM(
                model, device="cuda", dtype=dtype, attention_backend=backend, cuda_graphs=graphs
            )
            runs[name, dtype] = [o.token_ids for o in llm.chat(prompts, greedy)]
        del llm
        torch.cuda.empty_cache()
    pairs = [
        (("triton", "float32"), ("torch", "float32")),
        (("triton", "bfloat16"), ("torch", "bfloat16")),
        (("triton-eager", "bfloat16"), ("torch", "bfloat16")),
        (("torch", "bfloat16"), ("torch", "float32")),
        (("triton", "bfloat16"), ("torch", "float32")),
        (("torch-efficient", "bfloat16"), ("torch", "bfloat16")),
        (("torch-math", "bfloat16"), ("torch", "bfloat16")),
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
