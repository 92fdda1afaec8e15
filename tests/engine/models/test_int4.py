"""INT4 (W4A16) linear layers running a GGUF file's Q4_1 blocks as they are: the embedded
SmolLM2, whose linear layers are all Q4_1, gives the tokens of its dequantized self (its GPU
run, in CUDA graphs, is in test_gguf_blocks.py beside the Q8_0 one)."""

from __future__ import annotations

import pytest
import torch

from bench.prompts import chat_prompts
from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"


def test_embedded_model_runs_its_q4_1_blocks_with_the_dequantized_tokens(smollm2_llm) -> None:
    params = SamplingParams(max_tokens=4, temperature=0)
    convs = chat_prompts(2)
    llm = LLM(MODEL, device="cpu", dtype="float32", quantization="int4", kv_cache_memory=1 << 27)
    # The CPU path dequantizes the blocks to exactly the values the GGUF reader gives.
    want = [o.token_ids for o in smollm2_llm.chat(convs, params)]
    assert [o.token_ids for o in llm.chat(convs, params)] == want
    layer = llm.engine.runner.model.model.layers[3].self_attn.qkv_proj
    assert layer.qweight.dtype == torch.uint8 and not hasattr(layer, "weight")
    assert layer.qweight.shape == (576 + 2 * 192, 576 // 2)  # q, k, v rows; 2 codes a byte
    assert layer.scales.shape == layer.mins.shape == (960, 576 // 32)


def test_int4_needs_a_gguf_file(tmp_path) -> None:
    path = save_tiny_model("llama", tmp_path / "m")
    with pytest.raises(ValueError, match="int4 runs the Q4_0 / Q4_1 blocks of a GGUF file"):
        LLM(str(path), device="cpu", quantization="int4", kv_cache_memory=1 << 26)
