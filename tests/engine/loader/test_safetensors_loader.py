"""HF safetensors directories: config fields, every weight by name and value, shards, errors."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.engine.loader.cases import LLAMA3_ROPE, TINY_CASES
from tests.tiny_models import CHAT_TEMPLATE, save_tiny_model
from tokenmill.engine.loader import resolve_model_source

TinyDir = Callable[[str], Path]


def _hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def _check_weights_match(
    path: Path, tied: bool, expected: dict[str, torch.Tensor] | None = None
) -> None:
    expected = _hf_state_dict(path) if expected is None else expected
    got = dict(resolve_model_source(path).iter_weights())
    names = set(expected) - ({"lm_head.weight"} if tied else set())
    assert names <= set(got) <= set(expected)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("case", TINY_CASES)
def test_config_fields(case: str, tiny_hf_dir: TinyDir) -> None:
    arch, overrides = TINY_CASES[case]
    config = resolve_model_source(tiny_hf_dir(case)).load_config()
    assert (
        config.architecture
        == {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }[arch]
    )
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (288, 64, 128)
    assert (config.num_hidden_layers, config.num_attention_heads) == (2, 4)
    assert config.num_key_value_heads == 2
    assert config.head_dim == (32 if arch == "qwen3" else 16)
    assert config.rms_norm_eps == 1e-6 and config.rope_theta == 10000.0
    assert config.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert config.attention_bias == (arch == "qwen2")
    assert config.qk_norm == (arch == "qwen3")
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert config.source.endswith("config.json")
    if case == "llama3-rope":
        assert config.rope_type == "llama3"
        assert {k: config.rope_scaling[k] for k in LLAMA3_ROPE} == LLAMA3_ROPE
        assert config.max_position_embeddings == 16384
    else:
        assert config.rope_scaling is None and config.max_position_embeddings == 256


@pytest.mark.parametrize("case", TINY_CASES)
def test_weights_equal_hf_state_dict(case: str, tiny_hf_dir: TinyDir) -> None:
    _check_weights_match(tiny_hf_dir(case), TINY_CASES[case][1].get("tie_word_embeddings", False))


def test_sharded_checkpoint_loads_completely(tmp_path: Path) -> None:
    path = save_tiny_model("qwen3", tmp_path / "sharded", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 3
    _check_weights_match(path, tied=False)


def test_unindexed_safetensors_files_load(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path / "m", max_shard_size="40KB")
    expected = _hf_state_dict(path)
    (path / "model.safetensors.index.json").unlink()
    _check_weights_match(path, tied=False, expected=expected)


def test_a_tensor_stored_in_two_files_is_refused_naming_both(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path / "m", max_shard_size="40KB")
    (path / "model.safetensors.index.json").unlink()
    files = sorted(path.glob("*.safetensors"))
    first = load_file(files[0])
    name = next(iter(first))
    save_file({name: first[name].clone()}, path / "zz-extra.safetensors")
    with pytest.raises(ValueError, match=rf"{re.escape(name)} is stored in both .*zz-extra"):
        list(resolve_model_source(path).iter_weights())


def test_bfloat16_weights_keep_their_dtype(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path / "bf16", dtype=torch.bfloat16)
    source = resolve_model_source(path)
    assert source.load_config().torch_dtype == "bfloat16"
    assert {t.dtype for _, t in source.iter_weights()} == {torch.bfloat16}


def test_tokenizer_round_trips_with_chat_template(tiny_hf_dir: TinyDir) -> None:
    source = resolve_model_source(tiny_hf_dir("llama"))
    tokenizer = source.load_tokenizer()
    assert source.chat_template() == tokenizer.chat_template  # read without the tokenizer
    text = "Hello, wörld! 12 + 3"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.chat_template == CHAT_TEMPLATE
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token_id == 2


def test_a_named_tokenizer_class_goes_through_auto_tokenizer(
    tiny_hf_dir: TinyDir, tmp_path: Path
) -> None:
    """A generic tokenizer.json loads directly; one whose config names a model-specific class
    gets that class from AutoTokenizer, with the same ids."""
    plain = tmp_path / "plain"
    shutil.copytree(tiny_hf_dir("llama"), plain)
    named = tmp_path / "named"
    shutil.copytree(plain, named)
    config = json.loads((named / "tokenizer_config.json").read_text())
    (named / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"})
    )
    generic = resolve_model_source(plain).load_tokenizer()
    specific = resolve_model_source(named).load_tokenizer()
    assert type(generic).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert type(specific).__name__.startswith("GPT2Tokenizer")
    text = "Hello, wörld! 12 + 3"
    assert specific.encode(text) == generic.encode(text)


def test_truncated_safetensors_names_the_file(tiny_hf_dir: TinyDir, tmp_path: Path) -> None:
    path = shutil.copytree(tiny_hf_dir("llama"), tmp_path / "m")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    source = resolve_model_source(path)
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated or corrupt"):
        list(source.iter_weights())


def test_missing_shard_names_index_and_shard(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path / "m", max_shard_size="40KB")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"index\.json lists shard {shard.name}"):
        list(resolve_model_source(path).iter_weights())


def _edit_config(path: Path, **changes: object) -> None:
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def test_unsupported_architecture_names_config_and_supported(
    tiny_hf_dir: TinyDir, tmp_path: Path
) -> None:
    path = shutil.copytree(tiny_hf_dir("llama"), tmp_path / "m")
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*config\.json.*LlamaForCausalLM"):
        resolve_model_source(path).load_config()


def test_quantized_checkpoint_is_refused(tiny_hf_dir: TinyDir, tmp_path: Path) -> None:
    path = shutil.copytree(tiny_hf_dir("llama"), tmp_path / "m")
    _edit_config(path, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match=r"quantization_config.*config\.json.*gptq"):
        resolve_model_source(path).load_config()


def test_config_that_disagrees_with_weights_names_tensor(
    tiny_hf_dir: TinyDir, tmp_path: Path
) -> None:
    path = shutil.copytree(tiny_hf_dir("llama"), tmp_path / "m")
    _edit_config(path, intermediate_size=96)
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight in .*model\.safetensors"):
        list(resolve_model_source(path).iter_weights())


def test_invalid_config_json_names_file(tiny_hf_dir: TinyDir, tmp_path: Path) -> None:
    path = shutil.copytree(tiny_hf_dir("llama"), tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        resolve_model_source(path).load_config()


def test_missing_tokenizer_names_the_directory(tiny_hf_dir: TinyDir, tmp_path: Path) -> None:
    path = shutil.copytree(tiny_hf_dir("qwen2"), tmp_path / "m")
    for file in path.iterdir():
        if file.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            file.unlink()
    with pytest.raises(ValueError, match=rf"cannot load a tokenizer from {path}"):
        resolve_model_source(path).load_tokenizer()


def test_generation_config_eos_ids_stop_generation_as_in_hf(tmp_path: Path) -> None:
    """An end-of-turn id listed only in generation_config.json (Llama-3-Instruct's first
    release) stops the row, as HF generate stops there."""
    from tokenmill import LLM, SamplingParams

    path = save_tiny_model("llama", tmp_path / "m")
    prompt = [5, 17, 42, 99, 7]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    free = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    stop = int(free[0, len(prompt) + 5])  # a token the model emits greedily
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, stop]}))
    assert resolve_model_source(str(path)).load_config().eos_token_ids[-1] == stop
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    out = LLM(str(path), device="cpu", dtype="float32").generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0)
    )[0]
    assert list(out.token_ids) == want[0, len(prompt) :].tolist()
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        resolve_model_source(str(path)).load_config()


@pytest.mark.parametrize(
    ("arch", "key", "what"),
    [
        ("llama", "attention_bias", "o_proj"),
        ("qwen3", "attention_bias", "o_proj"),
        ("llama", "mlp_bias", "the MLP's projections"),
    ],
)
def test_biases_the_engine_does_not_build_are_refused_naming_the_key(
    tmp_path: Path, arch: str, key: str, what: str
) -> None:
    path = save_tiny_model(arch, tmp_path / "m", **{key: True})
    with pytest.raises(ValueError) as info:
        resolve_model_source(str(path)).load_config()
    message = str(info.value)
    assert f"config key {key} is true in {path / 'config.json'}" in message and what in message


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_an_index_naming_a_shard_outside_the_directory_is_refused(
    tmp_path: Path, where: str
) -> None:
    path = save_tiny_model("llama", tmp_path / "m", max_shard_size="40KB")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    moved = shutil.move(shard, tmp_path / shard.name)
    outside = str(moved) if where == "absolute" else f"../{shard.name}"
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {
        k: outside if v == shard.name else v for k, v in index["weight_map"].items()
    }
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"lists shard '{re.escape(outside)}', which is not a"):
        list(resolve_model_source(path).iter_weights())


def test_a_config_asking_for_more_memory_than_there_is_names_its_size(
    tiny_hf_dir: TinyDir, tmp_path: Path
) -> None:
    """The model is allocated before its weights are read: a config whose sizes do not belong
    to the weights must fail as a model that cannot be loaded, not as an allocator crash."""
    from tokenmill import LLM

    path = shutil.copytree(tiny_hf_dir("llama"), tmp_path / "m")
    _edit_config(path, hidden_size=1 << 20, intermediate_size=1 << 24)
    with pytest.raises(ValueError, match=r"parameters, [\d,.]+ GiB by the config's sizes, do not"):
        LLM(str(path), device="cpu")


def test_generation_config_stop_ids_replace_config_jsons_as_in_hf(tmp_path: Path) -> None:
    """HF generate stops at generation_config.json's eos ids when it has them; config.json's
    were added to them, stopping rows HF continues."""
    path = save_tiny_model("llama", tmp_path / "m")
    _edit_config(path, eos_token_id=116)
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [146]}))
    assert resolve_model_source(str(path)).load_config().eos_token_ids == (146,)
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert resolve_model_source(str(path)).load_config().eos_token_ids == (116,)
