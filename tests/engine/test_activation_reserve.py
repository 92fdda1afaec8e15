"""A KV cache budget that a step's activations leave short names the setting behind them
(max_num_batched_tokens or max_num_seqs) and says to lower it, beside kv_cache_memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tokenmill import LLM
from tokenmill.engine import engine_config
from tokenmill.engine.activation_reserve import activation_reserve
from tokenmill.engine.engine_config import EngineSettingError
from tokenmill.engine.loader.safetensors_loader import load_hf_config

GIB = 1 << 30
TOKENS = 10**9  # activations of terabytes: no host holds them
SEQS = 3 * 10**6  # logits of ~10 GiB beside a tiny model; slots of 64 tokens fit


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("reserve") / "m")


@pytest.fixture(autouse=True)
def host_of_8_gib_6_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_config, "host_memory", lambda: (8 * GIB, 6 * GIB))


def test_the_larger_part_names_its_setting(model: Path) -> None:
    config = load_hf_config(model)
    by_tokens = activation_reserve(config, torch.float32, TOKENS, 4)
    by_seqs = activation_reserve(config, torch.float32, 16, SEQS)
    assert by_tokens.nbytes == by_tokens.tokens_bytes + by_tokens.logits_bytes
    assert "lower max_num_batched_tokens" in by_tokens.why()
    assert "max_num_seqs=3000000 rows: lower max_num_seqs" in by_seqs.why()


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"max_num_batched_tokens": TOKENS}, "max_num_batched_tokens=1000000000 tokens a step"),
        ({"max_num_seqs": SEQS, "max_model_len": 64}, "the logits of max_num_seqs=3000000"),
    ],
)
@pytest.mark.parametrize("kv_cache_memory", [1 << 20, 0.5])
def test_a_budget_the_activations_leave_short_names_their_setting(
    model: Path, settings: dict[str, int], named: str, kv_cache_memory: float
) -> None:
    """An audit: large but host-fitting max_num_batched_tokens or max_num_seqs were refused
    as kv_cache_memory's fault ("less 2861.02 GiB for activations", or "room for at least 2
    KV blocks ... raise it, or lower block_size"), naming neither setting. A byte count
    meets the host check; a share is left no blocks."""
    with pytest.raises(EngineSettingError) as info:
        LLM(str(model), device="cpu", kv_cache_memory=kv_cache_memory, **settings)
    assert info.value.key == "kv_cache_memory"
    setting = named.split("=")[0].split()[-1]
    assert f"GiB for {named}" in str(info.value), info.value
    assert f"lower {setting} to need less" in str(info.value), info.value


def test_a_share_too_small_without_the_activations_says_nothing_of_them(model: Path) -> None:
    """Where the KV cache has no room even without the reserve, the reserve is not blamed."""
    with pytest.raises(EngineSettingError, match="raise it, or lower block_size\\), got") as info:
        LLM(str(model), device="cpu", kv_cache_memory=1e-9, block_size=2**20)
    assert "activations" not in str(info.value)
