"""Pre-quantized FP8 safetensors checkpoints load as they are (e4m3 weights, per-channel or
per-tensor weight_scale), and quantized formats the engine does not run are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.loader.safetensors_loader import load_hf_config
from tokenmill.engine.models.fp8 import FP8_MAX, quantize_rows


@pytest.fixture(scope="module")
def float_model(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("fp8ckpt") / "float")


def _fp8_checkpoint(src: Path, dst: Path, per_tensor: bool, **quant_config) -> Path:
    """``src``'s linear weights as e4m3 with their scales, the rest as it was."""
    shutil.copytree(src, dst)
    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        if not name.endswith("_proj.weight"):
            out[name] = t
            continue
        if per_tensor:
            scale = t.abs().max().float() / FP8_MAX
            q = (t.float() / scale).to(torch.float8_e4m3fn)
            out[name.replace(".weight", ".input_scale")] = torch.tensor(0.05)
        else:
            q, scale = quantize_rows(t)  # [out, in], [out, 1]
        out[name] = q
        out[name.replace(".weight", ".weight_scale")] = scale
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    scheme = "static" if per_tensor else "dynamic"
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": scheme,
        **quant_config,
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _generate(path: Path, **settings) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 280, (8 + i % 7,), generator=g).tolist() for i in range(60)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=1 << 26, **settings)
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_per_channel_checkpoint_equals_quantizing_at_load(float_model: Path, tmp_path) -> None:
    ckpt = _fp8_checkpoint(float_model, tmp_path / "fp8", per_tensor=False)
    assert load_hf_config(ckpt).quantization == "fp8"
    # The same e4m3 weights and scales either way: the same tokens, bit for bit.
    assert _generate(ckpt) == _generate(float_model, quantization="fp8")


def test_per_tensor_checkpoint_with_static_input_scales_runs(float_model: Path, tmp_path) -> None:
    ckpt = _fp8_checkpoint(float_model, tmp_path / "fp8", per_tensor=True)
    got, want = _generate(ckpt), _generate(float_model)
    # One scale a tensor is coarser than one a row: most first tokens still agree.
    assert sum(a[0] == b[0] for a, b in zip(got, want, strict=True)) >= 40


@pytest.mark.parametrize(
    ("quant_config", "found"),
    [
        ({"quant_method": "gptq", "bits": 4}, "gptq-quantized"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise scales"),
        ({"quant_method": "bitsandbytes"}, "bitsandbytes-quantized"),
    ],
)
def test_unsupported_quantizations_are_refused(float_model: Path, tmp_path, quant_config, found):
    path = shutil.copytree(float_model, tmp_path / "q")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quant_config
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as info:
        load_hf_config(path)
    message = str(info.value)
    assert str(path / "config.json") in message and found in message
    assert "FP8 safetensors" in message and "GGUF" in message  # what is supported


def test_e4m3_tensors_without_an_fp8_config_are_refused(float_model: Path, tmp_path) -> None:
    ckpt = _fp8_checkpoint(float_model, tmp_path / "fp8", per_tensor=False)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"float8_e4m3fn.*declares no quantization"):
        LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_memory=1 << 26)


@pytest.mark.parametrize("fnuz", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz])
def test_every_one_byte_float_outside_fp8_layers_is_refused(
    float_model: Path, tmp_path, fnuz: torch.dtype
) -> None:
    """The fnuz kinds loaded in a float checkpoint, cast without a scale; an FP8
    checkpoint's e4m3 embeddings loaded the same way (they have no weight_scale)."""
    plain = shutil.copytree(float_model, tmp_path / "plain")

    def to_fnuz(t: dict) -> None:
        name = "model.layers.0.mlp.down_proj.weight"
        t[name] = t[name].float().to(fnuz)

    with pytest.raises(ValueError, match=rf"{fnuz}, and config.json declares no quantization"):
        LLM(str(_edited(plain, to_fnuz)), device="cpu", dtype="float32", kv_cache_memory=1 << 26)

    def e4m3_embeddings(t: dict) -> None:
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].to(torch.float8_e4m3fn)

    fp8 = _edited(_fp8_checkpoint(float_model, tmp_path / "fp8", per_tensor=False), e4m3_embeddings)
    with pytest.raises(ValueError, match=r"embed_tokens.weight .*e4m3fn; an FP8 checkpoint stores"):
        LLM(str(fp8), device="cpu", dtype="float32", kv_cache_memory=1 << 26)


def test_calibrated_kv_cache_scales_are_left_unused(float_model: Path, tmp_path) -> None:
    """FP8 checkpoints calibrated for an FP8 KV cache carry k_scale / v_scale per layer: the
    engine's FP8 KV cache stores K and V unscaled, so they load and change nothing."""
    path = _fp8_checkpoint(float_model, tmp_path / "ckpt", per_tensor=False)
    want = _generate(path)
    weights = load_file(path / "model.safetensors")
    for i in range(2):
        for leaf in ("k_scale", "v_scale"):
            weights[f"model.layers.{i}.self_attn.{leaf}"] = torch.tensor(0.02)
    save_file(weights, path / "model.safetensors")
    assert _generate(path) == want


def _edited(path: Path, edit) -> Path:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")
    return path


def _e5m2(t: dict) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    t[name] = t[name].float().to(torch.float8_e5m2)


def _float_layer(t: dict) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    t[name] = t[name].float() * t[name.replace(".weight", ".weight_scale")]


def _scale_per_input(t: dict) -> None:
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    t[name] = torch.ones(1, t[name].shape[0])  # [1, in] on a square layer: not per output


def _nan_byte(t: dict) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    t[name].view(torch.uint8)[0, 0] = 0x7F  # e4m3's NaN


@pytest.mark.parametrize(
    ("edit", "refusal"),
    [
        (_e5m2, r"down_proj.weight .* has dtype torch.float8_e5m2.*; supported are .*fp8"),
        (_float_layer, r"down_proj.weight .* torch.float32; an FP8 .*; supported are .*fp8"),
        (_scale_per_input, r"o_proj.weight_scale .* per output channel"),
        (_nan_byte, r"down_proj.weight .* holds NaN"),
    ],
)
def test_fp8_checkpoints_that_would_run_wrong_are_refused(
    float_model: Path, tmp_path, edit, refusal: str
) -> None:
    """Each loaded and ran wrong: e5m2 weights cast as if e4m3 (logits off by 1.5x their
    size), a float layer cast to e4m3 with scale 1, a [1, in] scale taken per output
    channel, an e4m3 NaN byte (every logit NaN)."""
    path = _edited(_fp8_checkpoint(float_model, tmp_path / "m", per_tensor=False), edit)
    with pytest.raises(ValueError, match=refusal):
        LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=1 << 26)
