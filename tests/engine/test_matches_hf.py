"""Greedy outputs must be token-identical to HF transformers (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.prompts import chat_prompts
from tests.hf_reference import hf_greedy_choices
from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams


def test_smollm2_greedy_matches_hf_transformers(smollm2_llm, hf_smollm2) -> None:
    model, _ = hf_smollm2
    convs = chat_prompts(16, seed=1)
    prompt_ids = [smollm2_llm.encode_chat(c) for c in convs]
    assert len({len(p) for p in prompt_ids}) >= 8, "prompts should differ in length"
    outs = smollm2_llm.generate(prompt_ids, SamplingParams(max_tokens=48, temperature=0))
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    for ids, out in zip(prompt_ids, outs, strict=True):
        assert out.ok, out.error
        # HF generate's greedy continuation: its choice at every position, and its stop
        assert out.token_ids == hf_greedy_choices(model, ids, out.token_ids), out.text
        assert len(out.token_ids) == 48 or out.token_ids[-1] in eos, out.text
        assert not eos & set(out.token_ids[:-1]), out.text


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
TINY_CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
}


@pytest.mark.parametrize("case", TINY_CASES)
def test_tiny_model_greedy_matches_hf_transformers(case: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    arch, overrides = TINY_CASES[case]
    path = save_tiny_model(arch, tmp_path / case, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, kv_cache_memory=8 << 20)
    g = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 5, 17, 33, 8)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=20,
                min_new_tokens=20,
                do_sample=False,
            )
        assert out.token_ids == ref[0, len(ids) :].tolist()
