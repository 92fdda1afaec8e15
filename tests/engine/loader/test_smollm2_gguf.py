"""The real SmolLM2-135M-Instruct Q4_1 GGUF against transformers' own GGUF loader.

``hf_smollm2`` (tests/engine/conftest.py) is session-scoped: its ~15 s load is shared with the
engine's end-to-end tests.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.loader import ModelSource, resolve_model_source
from tokenmill.engine.model_config import ModelConfig


@pytest.fixture(scope="module")
def smollm2() -> ModelSource:
    return resolve_model_source("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smollm2_weights(smollm2: ModelSource) -> dict[str, torch.Tensor]:
    return dict(smollm2.iter_weights())


def test_config_has_the_known_shape(smollm2: ModelSource) -> None:
    assert smollm2.load_config() == ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def test_weights_equal_transformers_gguf_loader(
    smollm2_weights: dict[str, torch.Tensor], hf_smollm2: tuple
) -> None:
    expected = hf_smollm2[0].state_dict()
    assert set(smollm2_weights) == set(expected) - {"lm_head.weight"}  # tied
    # q/k of a middle layer prove the un-permutation; the rest cover each quant type (Q8_0
    # embedding, Q4_1 projections, F32 norms) and name.
    for name in (
        "model.layers.7.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.7.self_attn.v_proj.weight",
        "model.layers.29.self_attn.o_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ):
        got = smollm2_weights[name]
        assert got.dtype == torch.float32
        assert torch.equal(got, expected[name]), name


def test_tokenizer_round_trips_and_has_chat_template(smollm2: ModelSource) -> None:
    tokenizer = smollm2.load_tokenizer()
    assert smollm2.chat_template() == tokenizer.chat_template  # read without the tokenizer
    text = "The quick brown fox jumps over 13 lazy dogs."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) < len(text) and tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token_id == 1
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_is_the_one_auto_tokenizer_builds(
    smollm2: ModelSource, hf_smollm2: tuple
) -> None:
    """The loader builds the file's tokenizer without ``AutoTokenizer`` (11 s faster): the same
    pieces, special tokens and ids as transformers' own route."""
    ours, auto = smollm2.load_tokenizer(), hf_smollm2[1]
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert ours.special_tokens_map == auto.special_tokens_map
    assert ours.all_special_ids == auto.all_special_ids
    chat = [{"role": "user", "content": "Réponds: 12 + 30 = ? 🤖\n\tmerci"}]
    for text in (
        "The quick brown fox.",
        "  leading spaces and <|im_start|> inside",
        ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
    ):
        assert ours(text)["input_ids"] == auto(text)["input_ids"], text


def test_each_load_gets_its_own_copy_of_the_cached_tokenizer(smollm2: ModelSource) -> None:
    first, second = smollm2.load_tokenizer(), smollm2.load_tokenizer()
    assert first is not second and first.get_vocab() == second.get_vocab()
    first.chat_template = "{{ messages[0]['content'] }}"  # one caller's change stays its own
    assert second.chat_template == smollm2.chat_template() == smollm2.load_tokenizer().chat_template
