"""config.json values the engine reads, checked by type before use (a wrong type named the
key nowhere, or passed: "false" read as true, 1.9 layers as 1), transformers' precedence
where two keys say the same thing, and the HF hub cache's layout of links."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.tiny_models import save_tiny_model, tiny_config
from tokenmill import LLM, SamplingParams
from tokenmill.engine.model_config import ModelConfig

BASE: dict[str, Any] = tiny_config("llama").to_dict()  # the tiny test model's config.json


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("hidden_size", "sixty-four"),
        ("hidden_size", [64]),
        ("hidden_size", 64.7),
        ("num_hidden_layers", 1.9),
        ("rms_norm_eps", "abc"),
        ("eos_token_id", [2, None]),
        ("tie_word_embeddings", "false"),
        ("architectures", "LlamaForCausalLM"),
        ("rope_scaling", "linear"),
        ("rope_scaling", {"rope_type": "linear"}),
        ("rope_scaling", {"rope_type": "llama3", "original_max_position_embeddings": 64}),
        # values in range were not checked: garbage text, a ZeroDivisionError, or a failure
        # deep in torch naming neither the file nor the key
        ("rms_norm_eps", -1.0),
        # HF runs an eps of 0 as 0; it ran as 1e-6 here, silently (logprobs off by 1e-4)
        ("rms_norm_eps", 0.0),
        # as were these zeros, run as the head count, hidden / heads and 10,000
        ("num_key_value_heads", 0),
        ("head_dim", 0),
        ("rope_parameters", {"rope_type": "default", "rope_theta": 0}),
        ("rope_parameters", {"rope_type": "default", "rope_theta": float("nan")}),
        ("rope_scaling", {"rope_type": "linear", "factor": 0.0}),
        ("num_attention_heads", 0),
        ("num_key_value_heads", -4),
        ("max_position_embeddings", 2**63),
        ("bos_token_id", "x"),
        ("eos_token_id", 2**70),
    ],
)
def test_a_value_of_the_wrong_type_names_its_key(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=r"in config\.json") as info:
        ModelConfig.from_hf_dict({**BASE, key: value}, source="config.json")
    named = {"rope_scaling": "rope_scaling", "rope_parameters": "rope_theta"}.get(key, key)
    assert named in str(info.value) or "factor" in str(info.value)


def test_whole_floats_and_a_null_eps_are_read() -> None:
    nulls = dict.fromkeys(("rms_norm_eps", "num_key_value_heads", "head_dim", "rope_parameters"))
    config = ModelConfig.from_hf_dict({**BASE, "hidden_size": 64.0, **nulls, "rope_theta": None})
    assert config.hidden_size == 64 and config.rms_norm_eps == 1e-6
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.head_dim == 64 // config.num_attention_heads and config.rope_theta == 10000.0


def test_rope_parameters_win_over_a_legacy_rope_theta_as_in_transformers() -> None:
    raw = {**BASE, "rope_theta": 500000.0, "rope_parameters": {"rope_theta": 10000.0}}
    assert ModelConfig.from_hf_dict(raw).rope_theta == 10000.0


def _as_transformers_reads(arch: str, raw: dict[str, Any]) -> Any:
    import transformers

    cls = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
           "qwen3": "Qwen3Config"}[arch]  # fmt: skip
    return getattr(transformers, cls)(**raw)


@pytest.mark.parametrize(
    "rope",
    [
        # the legacy "type" inside rope_parameters: read as plain RoPE, the scaling dropped
        {"rope_parameters": {"type": "linear", "factor": 4.0}},
        # a legacy rope_scaling replaces rope_parameters whole; theta from the top level
        {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
         "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}},
        # theta inside rope_scaling wins over the top level
        {"rope_theta": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 4.0,
                                             "rope_theta": 5e5}},
        # llama3 without original_max_position_embeddings: max_position_embeddings
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0}},
    ],
)  # fmt: skip
def test_rope_settings_are_read_as_transformers_reads_them(rope: dict[str, Any]) -> None:
    raw = {k: v for k, v in BASE.items() if k not in ("rope_parameters", "rope_scaling")}
    raw |= rope
    ours = ModelConfig.from_hf_dict(json.loads(json.dumps(raw)))
    theirs = _as_transformers_reads("llama", json.loads(json.dumps(raw))).rope_parameters
    assert ours.rope_type == theirs["rope_type"] and ours.rope_theta == theirs["rope_theta"]
    for key, value in theirs.items():
        if key not in ("rope_type", "type", "rope_theta"):
            assert ours.rope_scaling is not None and ours.rope_scaling[key] == value, key


@pytest.mark.parametrize(
    ("arch", "keys"),
    [
        ("mistral", {}),  # no sliding_window key: transformers' 4096
        ("mistral", {"sliding_window": None}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 24}),  # max_window_layers 28
        ("qwen2", {"use_sliding_window": True}),
        ("qwen3", {"use_sliding_window": True, "max_window_layers": 40}),
        ("qwen3", {}),
    ],
)
def test_window_and_head_dim_defaults_are_transformers(arch: str, keys: dict[str, Any]) -> None:
    """An absent window key ran full attention where transformers slides, and Qwen3 without
    head_dim took hidden / heads where transformers takes 128."""
    raw = tiny_config(arch).to_dict()
    for key in ("sliding_window", "max_window_layers", "use_sliding_window", "layer_types",
                "head_dim"):  # fmt: skip
        raw.pop(key, None)
    raw |= {"num_hidden_layers": 30} | keys
    ours = ModelConfig.from_hf_dict(json.loads(json.dumps(raw)))
    theirs = _as_transformers_reads(arch, json.loads(json.dumps(raw)))
    sliding = "sliding_attention" in (getattr(theirs, "layer_types", None) or [])
    if arch == "mistral":
        sliding = theirs.sliding_window is not None
    assert ours.sliding_window == (theirs.sliding_window if sliding else None)
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert ours.head_dim == head_dim


def test_bias_keys_transformers_ignores_are_ignored() -> None:
    mistral = tiny_config("mistral").to_dict() | {"attention_bias": True, "mlp_bias": True}
    assert ModelConfig.from_hf_dict(mistral).architecture == "MistralForCausalLM"
    qwen3 = tiny_config("qwen3").to_dict() | {"attention_bias": True}
    with pytest.raises(ValueError, match=r"attention_bias is true.*biases on q/k/v/o_proj"):
        ModelConfig.from_hf_dict(qwen3)


def test_a_sharded_model_in_the_hub_caches_layout_loads(tmp_path: Path) -> None:
    """snapshots/<rev>/ holds links to ../../blobs/<hash>: the index's shards were refused as
    files outside the model's directory."""
    model = save_tiny_model("llama", tmp_path / "m", max_shard_size="100KB")
    assert (model / "model.safetensors.index.json").is_file()
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(model.iterdir())):
        blob = blobs / f"blob{i}"
        blob.write_bytes(file.read_bytes())
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    want = LLM(str(model), device="cpu", dtype="float32").generate([[5, 6, 7]], greedy)[0]
    got = LLM(str(snapshot), device="cpu", dtype="float32").generate([[5, 6, 7]], greedy)[0]
    assert got.token_ids == want.token_ids
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_an_unreadable_weights_file_is_named_as_such(tmp_path: Path) -> None:
    """safetensors reports a file it may not read as missing ("No such file"): the message
    said to re-download a file that was there."""
    model = save_tiny_model("llama", tmp_path / "m")
    weights = model / "model.safetensors"
    weights.chmod(0)
    try:
        if os.access(weights, os.R_OK):
            pytest.skip("this user reads any file (root)")
        with pytest.raises(PermissionError, match="model.safetensors cannot be read"):
            LLM(str(model), device="cpu")
    finally:
        weights.chmod(0o644)
