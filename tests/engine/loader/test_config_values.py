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
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
    ],
)
def test_a_value_of_the_wrong_type_names_its_key(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=r"in config\.json") as info:
        ModelConfig.from_hf_dict({**BASE, key: value}, source="config.json")
    named = "rope_scaling" if key == "rope_scaling" else key
    assert named in str(info.value) or "factor" in str(info.value)


def test_whole_floats_and_a_null_eps_are_read() -> None:
    config = ModelConfig.from_hf_dict({**BASE, "hidden_size": 64.0, "rms_norm_eps": None})
    assert config.hidden_size == 64 and config.rms_norm_eps == 1e-6


def test_rope_parameters_win_over_a_legacy_rope_theta_as_in_transformers() -> None:
    raw = {**BASE, "rope_theta": 500000.0, "rope_parameters": {"rope_theta": 10000.0}}
    assert ModelConfig.from_hf_dict(raw).rope_theta == 10000.0


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
