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
    # min_tokens blocks EOS as HF's min_new_tokens does (ignore_eos would still emit it)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, min_tokens=20, temperature=0))
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


@pytest.mark.parametrize(
    ("arch", "window_settings", "window"),
    [
        ("mistral", {"sliding_window": 24}, 24),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 0}, 24),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 24}, None),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 2}, None),
    ],
)
def test_a_sliding_window_bounds_max_model_len_where_outputs_equal_hf(
    arch: str, window_settings: dict, window: int | None, tmp_path: Path, caplog
) -> None:
    """The engine has no sliding-window attention: a model whose layers slide runs only
    sequences that fit one window, where full attention is the same (greedy = HF), and a
    longer prompt is refused naming the window; a window no layer uses changes nothing."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(arch, tmp_path / "m", **window_settings)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with caplog.at_level("WARNING", logger="tokenmill.engine.llm_engine"):
        llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, kv_cache_memory=8 << 20)
    assert llm.engine.model_config.sliding_window == window
    limit = window or llm.engine.model_config.max_position_embeddings
    assert llm.engine.max_model_len == limit
    assert ("slides over windows of 24 tokens" in caplog.text) is (window is not None)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, hf.config.vocab_size, (14,), generator=g).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=10, min_tokens=10, temperature=0))
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, 14, dtype=torch.long),
            max_new_tokens=10, min_new_tokens=10, do_sample=False,
        )  # fmt: skip
    assert out[0].token_ids == ref[0, 14:].tolist()
    if window is not None:
        with pytest.raises(ValueError, match="slides over windows of 24 tokens"):
            llm.engine.add_request("long", list(range(3, 33)), SamplingParams(max_tokens=2))


def test_an_activation_other_than_silu_is_refused(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path / "m", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act is 'gelu'.*SiLU-gated"):
        LLM(str(path), device="cpu")


def test_a_lowered_max_model_len_is_warned_of_and_named_in_the_refusal(
    tmp_path: Path, caplog
) -> None:
    path = save_tiny_model("llama", tmp_path / "m", max_position_embeddings=512)
    with caplog.at_level("WARNING", logger="tokenmill.engine.llm_engine"):
        llm = LLM(str(path), device="cpu", block_size=4, max_model_len=100_000,
                  kv_cache_memory=96 << 10)  # fmt: skip
    assert "max_model_len 100000 lowered to 512: the model's context" in caplog.text
    limit = llm.engine.max_model_len
    assert limit < 512 and f"max_model_len 512 lowered to {limit}: all the KV cache" in caplog.text
    with pytest.raises(ValueError, match=r"raise kv_cache_memory for longer sequences"):
        llm.engine.add_request("long", [5] * limit, SamplingParams(max_tokens=2))
