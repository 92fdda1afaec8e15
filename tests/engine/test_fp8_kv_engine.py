"""engine.kv_cache_dtype fp8: the KV cache holds e4m3 values, so the same memory holds more
blocks; both attention backends store and read it the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("fp8kv") / "m")


def _run(path: Path, rows: int = 24, tokens: int = 10, **settings) -> tuple[list[list[int]], LLM]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 280, (6 + i % 9,), generator=g).tolist() for i in range(rows)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, kv_cache_memory=1 << 22,
              max_num_batched_tokens=32, **settings)  # fmt: skip
    return [o.token_ids for o in llm.generate(prompts, params)], llm


def test_fp8_kv_cache_holds_more_blocks_and_keeps_most_tokens(model_path: Path) -> None:
    want, full = _run(model_path)
    got, fp8 = _run(model_path, kv_cache_dtype="fp8")
    assert fp8.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    # fp32 -> e4m3: a quarter of the bytes a value, four times the blocks in 4 MiB
    assert fp8.engine.runner.num_blocks == 4 * full.engine.runner.num_blocks
    same = sum(a[0] == b[0] for a, b in zip(got, want, strict=True))
    assert same >= 18, same  # a random tiny model's near-ties may flip


def test_torch_and_triton_backends_agree_on_an_fp8_cache(model_path: Path) -> None:
    """Chunked prefill (32-token steps) and decode rows read the FP8 cache in both (the
    Triton kernels in the interpreter: fewer rows)."""
    torch_out, _ = _run(model_path, 6, 5, kv_cache_dtype="fp8", attention_backend="torch")
    triton_out, _ = _run(model_path, 6, 5, kv_cache_dtype="fp8", attention_backend="triton")
    assert triton_out == torch_out
