"""GGUF files converted from tiny HF models: same config, same weights, llama q/k un-permuted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.engine.loader.cases import TINY_CASES
from tests.engine.loader.tiny_gguf import write_tiny_gguf
from tokenmill.engine.loader import resolve_model_source
from tokenmill.engine.loader.gguf_config import llama3_freq_factors
from tokenmill.engine.loader.gguf_loader import hf_tensor_name, unpermute_rope_rows
from tokenmill.engine.model_config import ModelConfig

TinyPath = Callable[[str], Path]
GGUF_CASES = [case for case in TINY_CASES if TINY_CASES[case][0] != "mistral"]


@pytest.mark.parametrize("case", GGUF_CASES)
def test_config_matches_hf_directory(case: str, tiny_hf_dir: TinyPath, tiny_gguf: TinyPath) -> None:
    from_hf = resolve_model_source(tiny_hf_dir(case)).load_config()
    from_gguf = resolve_model_source(tiny_gguf(case)).load_config()
    assert from_gguf == from_hf
    assert from_gguf.source == str(tiny_gguf(case))


def test_mistral_gguf_loads_as_llama(tiny_hf_dir: TinyPath, tiny_gguf: TinyPath) -> None:
    # llama.cpp writes Mistral as general.architecture "llama"; the model is the same.
    from_gguf = resolve_model_source(tiny_gguf("mistral")).load_config()
    from_hf = resolve_model_source(tiny_hf_dir("mistral")).load_config()
    assert from_gguf.architecture == "LlamaForCausalLM"
    assert from_gguf == ModelConfig(**{**vars(from_hf), "architecture": "LlamaForCausalLM"})


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_weights_equal_safetensors(case: str, tiny_hf_dir: TinyPath, tiny_gguf: TinyPath) -> None:
    expected = load_file(tiny_hf_dir(case) / "model.safetensors")
    got = dict(resolve_model_source(tiny_gguf(case)).iter_weights())
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name


def test_unpermute_inverts_llama_cpp_permute() -> None:
    n_heads, head_dim, hidden = 3, 8, 5
    hf = np.arange(n_heads * head_dim * hidden, dtype=np.float32).reshape(-1, hidden)
    # llama.cpp: per head, row (half, i) moves to (i, half).
    permuted = hf.reshape(n_heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(permuted, hf)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_heads), hf)
    bias = np.arange(n_heads * head_dim, dtype=np.float32)
    permuted_bias = bias.reshape(n_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted_bias, n_heads), bias)


def test_tensor_name_mapping() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert hf_tensor_name("blk.1.ffn_norm.weight") == (
        "model.layers.1.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None


def test_llama3_freq_factors_match_transformers(tiny_gguf: TinyPath) -> None:
    reader = gguf.GGUFReader(tiny_gguf("llama3-rope"))
    stored = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
    ours = llama3_freq_factors(16, 10000.0, 8.0, 1.0, 4.0, 8192)
    assert 1.0 < ours[-2] < 8.0, "the tiny case should cover the smooth band"
    np.testing.assert_allclose(stored, ours, rtol=1e-6)


def test_truncated_gguf_names_the_file(tiny_gguf: TinyPath, tmp_path: Path) -> None:
    data = tiny_gguf("llama").read_bytes()
    for cut, label in ((len(data) - 4096, "data"), (200, "metadata")):
        path = tmp_path / f"cut-{label}.gguf"
        path.write_bytes(data[:cut])
        source = resolve_model_source(path)  # the magic is intact; reading finds the damage
        with pytest.raises(ValueError, match=rf"GGUF file {path} is (corrupt or )?truncated"):
            source.load_config()


def test_unsupported_gguf_architecture(tiny_hf_dir: TinyPath, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny_hf_dir("llama"), tmp_path / "phi.gguf", gguf_arch="phi3")
    with pytest.raises(ValueError, match=rf"architecture 'phi3'.*{path}; supported: llama, qwen2"):
        resolve_model_source(path).load_config()


def test_unknown_tensor_names_the_file(tiny_hf_dir: TinyPath, tmp_path: Path) -> None:
    path = tmp_path / "extra.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in [
        ("block_count", 1),
        ("context_length", 64),
        ("embedding_length", 8),
        ("feed_forward_length", 16),
        ("attention.head_count", 2),
    ]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((32, 8), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    source = resolve_model_source(path)
    assert source.load_config().vocab_size == 32
    with pytest.raises(ValueError, match=rf"blk\.0\.ffn_gate_exps\.weight in {path}"):
        list(source.iter_weights())


def test_linear_rope_scaling_metadata(tiny_hf_dir: TinyPath, tmp_path: Path) -> None:
    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_string("qwen3.rope.scaling.type", "linear")
        writer.add_float32("qwen3.rope.scaling.factor", 2.0)

    path = write_tiny_gguf(tiny_hf_dir("qwen3"), tmp_path / "linear.gguf", extra=linear)
    config = resolve_model_source(path).load_config()
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize(
    ("add", "refusal"),
    [
        (lambda w: (w.add_string("llama.rope.scaling.type", "linear"),
                    w.add_string("llama.rope.scaling.factor", "4")),
         r"llama.rope.scaling.factor in .* must be a number"),
        (lambda w: w.add_array("tokenizer.ggml.eot_token_id", [2]),
         r"tokenizer.ggml.eot_token_id in .* must be a token id"),
        (lambda w: (w.add_string("llama.rope.scaling.type", "linear"),
                    w.add_float32("llama.rope.scaling.factor", 0.0)),
         r"rope_scaling factor must be a positive number"),
    ],
)  # fmt: skip
def test_metadata_of_the_wrong_type_or_range_is_refused_naming_the_key(
    tiny_hf_dir: TinyPath, tmp_path: Path, add, refusal: str
) -> None:
    """Values were converted (a string, a float count) or taken as they came (an array for
    an id: a TypeError; a factor of 0: garbage text)."""
    path = write_tiny_gguf(tiny_hf_dir("llama"), tmp_path / "odd.gguf", extra=add)
    with pytest.raises(ValueError, match=refusal):
        resolve_model_source(path).load_config()


def test_unsupported_rope_scaling_names_the_file(tiny_hf_dir: TinyPath, tmp_path: Path) -> None:
    def yarn(writer: gguf.GGUFWriter) -> None:
        writer.add_string("qwen2.rope.scaling.type", "yarn")
        writer.add_float32("qwen2.rope.scaling.factor", 4.0)
        writer.add_uint32("qwen2.rope.scaling.original_context_length", 32768)

    path = write_tiny_gguf(tiny_hf_dir("qwen2"), tmp_path / "yarn.gguf", extra=yarn)
    with pytest.raises(ValueError, match=rf"rope_scaling type 'yarn' in {path}; supported"):
        resolve_model_source(path).load_config()


def test_rope_freqs_that_are_not_llama3_are_refused(tiny_hf_dir: TinyPath, tmp_path: Path) -> None:
    def odd_freqs(writer: gguf.GGUFWriter) -> None:
        writer.add_tensor("rope_freqs.weight", np.linspace(1, 3, 8, dtype=np.float32))

    path = write_tiny_gguf(tiny_hf_dir("llama"), tmp_path / "odd.gguf", extra=odd_freqs)
    with pytest.raises(ValueError, match=rf"rope_freqs\.weight in {path} is not Llama-3"):
        resolve_model_source(path).load_config()


def test_gguf_without_tokenizer_metadata_names_the_file(tiny_gguf: TinyPath) -> None:
    path = tiny_gguf("qwen2")
    with pytest.raises(ValueError, match=rf"tokenizer\.ggml\.\* metadata of {path}"):
        resolve_model_source(path).load_tokenizer()
