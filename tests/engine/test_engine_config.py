"""EngineConfig: every field has a default-passing rule, bad values name their key."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from types import SimpleNamespace

import pytest

from tokenmill.engine.engine_config import EngineConfig, EngineSettingError, Rule

ROOT = Path(__file__).resolve().parents[2]


def test_every_field_has_a_rule_its_default_meets() -> None:
    for f in fields(EngineConfig):
        rule = f.metadata["rule"]
        assert isinstance(rule, Rule), f.name
        if f.default is not MISSING:
            assert rule.accepts(f.default), f.name
    assert EngineConfig.setting_names() == tuple(f.name for f in fields(EngineConfig))[1:]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("model", ""),
        ("dtype", "float8"),
        ("device", "cuda:x"),
        ("max_num_seqs", True),
        ("max_num_batched_tokens", 0),
        ("max_model_len", 1),
        ("block_size", 12),
        ("kv_cache_memory", float("nan")),
        ("enable_prefix_caching", 1),
        ("attention_backend", "flash"),
        ("cuda_graphs", None),
        ("load_format", "pt"),
        ("profile_steps", "yes"),
        ("async_scheduling", 0),
        ("seed", 1.0),
    ],
)
def test_a_bad_value_names_its_key(key: str, value: object) -> None:
    settings = {"model": "m", key: value}
    with pytest.raises(EngineSettingError) as info:
        EngineConfig(**settings)  # type: ignore[arg-type]
    assert info.value.key == key and info.value.value is value
    assert str(info.value).startswith(f"{key}: expected ")


def test_messages_stay_short_for_huge_values() -> None:
    for value in ("x" * 10**6, list(range(10**5)), 10**5000):
        with pytest.raises(EngineSettingError) as info:
            EngineConfig(model="m", device=value)  # type: ignore[arg-type]
        assert len(str(info.value)) < 200


def test_from_settings_refuses_unknown_keys() -> None:
    assert EngineConfig.from_settings("m", block_size=8) == EngineConfig(model="m", block_size=8)
    with pytest.raises(TypeError, match=r"unknown engine setting\(s\) warp_speed; the settings"):
        EngineConfig.from_settings("m", warp_speed=9)


def test_import_does_not_load_torch() -> None:
    """The job spec validates against EngineConfig in commands that never run a model."""
    probe = "import sys, tokenmill.engine.engine_config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_resolve_dtype_on_either_device() -> None:
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # no GPU needed to name one
    auto = EngineConfig(model="m")
    for stored, on_gpu in [
        ("float32", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("torch.float16", torch.float16),
        ("int8", torch.bfloat16),
    ]:
        config = SimpleNamespace(torch_dtype=stored)
        assert auto.resolve_dtype(config, cuda) == on_gpu  # type: ignore[arg-type]
        assert auto.resolve_dtype(config, cpu) == torch.float32  # type: ignore[arg-type]
    bf16 = EngineConfig(model="m", dtype="bf16")
    assert bf16.resolve_dtype(SimpleNamespace(torch_dtype="float32"), cpu) == torch.bfloat16  # type: ignore[arg-type]


def test_a_gpu_past_those_visible_is_refused_naming_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An audit: cuda:1 where one GPU is visible (a Ray replica sees its own alone, as
    cuda:0) passed, to fail deep in the model's load with CUDA's invalid device ordinal."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert EngineConfig(model="m", device="cuda:0").resolve_device() == torch.device("cuda:0")
    assert EngineConfig(model="m", device="cuda").resolve_device() == torch.device("cuda")
    said = r"^device: expected cuda, auto or cuda:0 to cuda:0 \(the GPUs visible\), got 'cuda:1'$"
    with pytest.raises(EngineSettingError, match=said):
        EngineConfig(model="m", device="cuda:1").resolve_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineSettingError, match=r"^device: expected cpu or auto \(no CUDA"):
        EngineConfig(model="m", device="cuda:0").resolve_device()


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
def test_a_seed_past_64_signed_bits_is_refused_naming_seed(seed: int) -> None:
    """An audit: LLM(seed=2**64) passed, loaded the weights and failed in torch's
    manual_seed ("Overflow when unpacking long long"), naming no setting; 2**63 ran. The
    engine seed now has SamplingParams.seed's range, and is refused before any loading."""
    from tokenmill import LLM

    said = rf"^seed: expected an integer in \[-2\*\*63, 2\*\*63 - 1\] .*, got {seed}$"
    with pytest.raises(EngineSettingError, match=said):
        EngineConfig(model="m", seed=seed)
    with pytest.raises(EngineSettingError, match=said):  # no such model: nothing was loaded
        LLM("/no/such/model", seed=seed)
    for kept in (2**63 - 1, -(2**63)):
        assert EngineConfig(model="m", seed=kept).seed == kept


@pytest.mark.parametrize("block_size", [2**40, 2**31])
def test_a_block_size_past_the_kernels_range_is_refused_naming_block_size(block_size: int) -> None:
    """An audit: block_size=2**40 passed, loaded the weights and was refused naming
    kv_cache_memory ("room for at least 2 KV blocks"). The kernels count keys in int32: a
    block past 2**30 is refused before any loading, naming block_size and the range."""
    from tokenmill import LLM

    said = rf"^block_size: expected a power of two from 1 to 2\*\*30 .*, got {block_size}$"
    with pytest.raises(EngineSettingError, match=said):
        EngineConfig(model="m", block_size=block_size)
    with pytest.raises(EngineSettingError, match=said):  # no such model: nothing was loaded
        LLM("/no/such/model", block_size=block_size)
    assert EngineConfig(model="m", block_size=2**30).block_size == 2**30
