"""GPTQ and AWQ int4 safetensors checkpoints load repacked for the W4A16 layer.

The checkpoints are built here from a tiny random Llama: each linear weight is quantized to 4
bits per group of inputs (asymmetric: a scale and a zero a group), packed by this file's own
packers in the GPTQ (v1 and v2) and AWQ GEMM conventions, and saved with a quantization_config.
The engine's layers must dequantize to exactly the fake-quantized weights, and generate the
greedy tokens of a float checkpoint holding those weights.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.loader.int4_checkpoints import (
    edit_config,
    int32_words,
    pack_gptq,
    quantize_act_order,
    quantize_int4,
    write_int4_checkpoint,
)
from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.attention.backend import get_attention_backend
from tokenmill.engine.loader.awq_gptq import gptq_q4_rows
from tokenmill.engine.loader.checkpoint_quant import layer_quantization
from tokenmill.engine.loader.safetensors_loader import iter_safetensors_weights, load_hf_config
from tokenmill.engine.model_loader import build_model
from tokenmill.engine.parallel import ParallelConfig
from tokenmill.kernels.w4a16_gemm import dequantize_q4, w4a16_linear


@pytest.fixture(scope="module")
def float_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("awq_gptq") / "float")


def _llm(path: Path) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_memory=1 << 26)


def _greedy(llm: LLM) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 280, (6 + i % 5,), generator=g).tolist() for i in range(12)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def _linears(model: torch.nn.Module, i: int) -> dict[str, torch.nn.Module]:
    """Layer ``i``'s (merged) linear layers by name."""
    attn, mlp = model.model.layers[i].self_attn, model.model.layers[i].mlp
    return {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj,
            "gate_up_proj": mlp.gate_up_proj, "down_proj": mlp.down_proj}  # fmt: skip


def _rank_model(ckpt: Path, rank: int, tp_size: int) -> torch.nn.Module:
    """Tensor-parallel rank ``rank`` of ``tp_size``'s model of ``ckpt`` (CPU, fp32)."""
    config = load_hf_config(ckpt)
    return build_model(
        config,
        get_attention_backend("torch", config.num_key_value_heads // tp_size),
        16,
        torch.device("cpu"),
        torch.float32,
        iter_safetensors_weights(ckpt, config),
        parallel=ParallelConfig(tp_rank=rank, tp_size=tp_size),
        quantization=layer_quantization(config.quantization, "none"),
    )


def _layer_weights(model: torch.nn.Module, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s linear layers, dequantized: name -> [out, in] fp32."""
    return {k: dequantize_q4(m.qweight, m.scales, m.mins) for k, m in _linears(model, i).items()}


def _want_weights(fq: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}"
    a, m = f"{p}.self_attn", f"{p}.mlp"
    return {
        "qkv_proj": torch.cat([fq[f"{a}.{x}_proj.weight"] for x in "qkv"]),
        "o_proj": fq[f"{a}.o_proj.weight"],
        "gate_up_proj": torch.cat([fq[f"{m}.gate_proj.weight"], fq[f"{m}.up_proj.weight"]]),
        "down_proj": fq[f"{m}.down_proj.weight"],
    }


# --- loading and running -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "group", "sym"),
    [
        ("gptq", 32, False),
        ("gptq", 64, True),
        ("gptq_v2", 64, False),
        ("awq", 32, False),
        ("awq", 64, False),
    ],
)
def test_checkpoint_runs_its_fake_quantized_weights(
    float_model: Path, tmp_path: Path, fmt: str, group: int, sym: bool
) -> None:
    ckpt, float_ckpt, fq = write_int4_checkpoint(float_model, tmp_path / fmt, fmt, group, sym)
    assert load_hf_config(ckpt).quantization == f"{fmt}-g{group}"
    llm = _llm(ckpt)
    model = llm.engine.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.uint8 and not hasattr(qkv, "weight")
    assert qkv.scales.shape == qkv.mins.shape == (64 + 2 * 32, 64 // group)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # left float
    for i in range(2):
        got, want = _layer_weights(model, i), _want_weights(fq, i)
        for key in want:
            assert torch.equal(got[key], want[key]), (i, key)  # (a) bit for bit
    # (b) the same weights as a float checkpoint: the same greedy tokens
    assert _greedy(llm) == _greedy(_llm(float_ckpt))


def test_fp16_mins_stay_within_half_an_fp16_step_of_the_zero_point_product() -> None:
    """The layer keeps -zero * scale in fp16 (the q4-rows layout), so its weights differ from
    (q - zero) * scale by at most that product's fp16 rounding."""
    q = quantize_int4(
        torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.05, 32, 0
    )
    zs = (q["zeros"] * q["scales"].float()).repeat_interleave(32, dim=1)
    bound = zs * 2.0**-11 + 1e-12  # half an ulp of fp16's 11-bit significand
    assert ((q["fq"] - q["exact"]).abs() <= bound).all()


def test_gptq_v1_reads_a_stored_15_as_zero_16() -> None:
    """AutoGPTQ stores zero - 1 and adds the 1 back without wrapping (a zero of 0 that its
    packer wrapped to 15 reads as 16): the repacked mins follow it."""
    qweight = torch.zeros(4, 8, dtype=torch.int32)  # 32 inputs, 8 outputs, all codes 0
    qzeros = int32_words(torch.tensor([[0xF0000007]]))  # stored zeros: 7, six 0s, 15
    scales = torch.ones(1, 8, dtype=torch.float16)
    _, _, mins = gptq_q4_rows(qweight, qzeros, scales, zero_offset=1)
    assert mins[:, 0].tolist() == [-8.0, -1, -1, -1, -1, -1, -1, -16.0]


def test_tensor_parallel_ranks_load_their_rows_and_columns(
    float_model: Path, tmp_path: Path
) -> None:
    """Rank r of 2: q, k and v rows [r/2, (r+1)/2) of each part in qkv_proj, input columns
    (and so groups) [r/2, (r+1)/2) in o_proj and down_proj, as for any weight."""
    ckpt, _, fq = write_int4_checkpoint(float_model, tmp_path / "awq", "awq", 32)
    want = _want_weights(fq, 1)
    a = "model.layers.1.self_attn"
    for rank in range(2):
        model = _rank_model(ckpt, rank, 2)
        got = _layer_weights(model, 1)
        rows = [fq[f"{a}.{x}_proj.weight"].chunk(2)[rank] for x in "qkv"]
        assert torch.equal(got["qkv_proj"], torch.cat(rows))
        assert torch.equal(got["o_proj"], want["o_proj"].chunk(2, dim=1)[rank])
        assert torch.equal(got["down_proj"], want["down_proj"].chunk(2, dim=1)[rank])


def test_a_layer_split_over_two_shard_files_is_repacked_whole(
    float_model: Path, tmp_path: Path
) -> None:
    ckpt, _, _ = write_int4_checkpoint(float_model, tmp_path / "gptq", "gptq", 32)
    config = load_hf_config(ckpt)
    want = dict(iter_safetensors_weights(ckpt, config))
    tensors = load_file(ckpt / "model.safetensors")
    layer = "model.layers.0.mlp.up_proj"
    first = {n: t for n, t in tensors.items() if n.endswith(".qweight")}  # qweights, then
    shards = {"model-00001-of-00002.safetensors": first,  # the layers' other parts
              "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items()
                                                   if n not in first}}  # fmt: skip
    (ckpt / "model.safetensors").unlink()
    for file, part in shards.items():
        save_file(part, ckpt / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = dict(iter_safetensors_weights(ckpt, config))
    assert f"{layer}.mins" in got and got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_desc_act_needs_each_layer_g_idx_in_input_order(float_model: Path, tmp_path: Path) -> None:
    """desc_act true with g_idx in input order (static groups) loads; without a g_idx to show
    the order, it is refused."""
    ckpt, _, _ = write_int4_checkpoint(float_model, tmp_path / "gptq", "gptq", 32)
    edit_config(ckpt, quantization_config=_gptq(desc_act=True))
    config = load_hf_config(ckpt)
    assert config.quantization == "gptq-g32-desc_act"
    assert len(list(iter_safetensors_weights(ckpt, config))) > 0
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.g_idx"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"desc_act true, but layer model\.layers\.1\.self_attn"):
        list(iter_safetensors_weights(ckpt, config))


def test_w4a16_kernel_runs_a_repacked_layer_in_the_interpreter(
    float_model: Path, tmp_path: Path
) -> None:
    ckpt, _, fq = write_int4_checkpoint(float_model, tmp_path / "gptq", "gptq", 32)
    layer = _llm(ckpt).engine.runner.model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    y = w4a16_linear(x, layer.qweight, layer.scales, layer.mins)
    want = x @ fq["model.layers.0.mlp.down_proj.weight"].t()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)  # fp32 dots, summed in order


# --- refusals ------------------------------------------------------------------------------


def _gptq(**changes: object) -> dict[str, object]:
    return {"quant_method": "gptq", "bits": 4, "group_size": 32, **changes}


def _awq(**changes: object) -> dict[str, object]:
    base = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    return {**base, "zero_point": True, **changes}


@pytest.mark.parametrize(
    ("quant_config", "found"),
    [
        (_gptq(bits=8), "gptq-quantized with bits 8"),
        (_gptq(group_size=-1), "gptq-quantized with group_size -1"),
        (_gptq(group_size=48), "gptq-quantized with group_size 48"),
        (_gptq(group_size=128), "group_size 128, which does not divide hidden_size 64"),
        (_gptq(bits="4"), "gptq-quantized with bits '4'"),
        (_gptq(checkpoint_format="marlin"), "gptq-quantized with checkpoint_format marlin"),
        (_gptq(lm_head=True), "gptq-quantized with lm_head true"),
        (_awq(version="gemv"), "awq-quantized with version gemv"),
        (_awq(version="GEMV_FAST"), "awq-quantized with version gemv_fast"),
        (_awq(zero_point=False), "awq-quantized with zero_point False"),
        (_awq(group_size=-1), "awq-quantized with group_size -1"),
        (_awq(modules_to_not_convert=["mlp"]), "awq-quantized with modules_to_not_convert"),
    ],
)
def test_unsupported_int4_configs_are_refused_naming_config_json(
    float_model: Path, tmp_path: Path, quant_config: dict, found: str
) -> None:
    path = shutil.copytree(float_model, tmp_path / "q")
    edit_config(path, quantization_config=quant_config)
    with pytest.raises(ValueError) as info:
        load_hf_config(path)
    message = str(info.value)
    assert str(path / "config.json") in message and found in message
    assert "GPTQ int4 safetensors" in message and "AWQ int4 safetensors" in message


def test_g_idx_out_of_order_without_desc_act_is_refused_naming_the_tensor(
    float_model: Path, tmp_path: Path
) -> None:
    ckpt, _, _ = write_int4_checkpoint(float_model, tmp_path / "gptq", "gptq", 32)
    tensors = load_file(ckpt / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.g_idx"
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    tensors[name] = tensors[name][perm].contiguous()
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError) as info:
        _llm(ckpt)
    message = str(info.value)
    assert f"tensor {name} in {ckpt / 'model.safetensors'}" in message
    assert "desc_act false" in message and "set desc_act true" in message


# --- act-order (desc_act) ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_act_order_checkpoint_runs_its_fake_quantized_weights(
    float_model: Path, tmp_path: Path, fmt: str
) -> None:
    """Inputs quantized in a random order per input (shared by q/k/v and by gate/up): each
    layer holds its rows with the inputs sorted by group and that order, and multiplies x
    as the checkpoint's weight does; greedy tokens equal the float checkpoint's."""
    ckpt, float_ckpt, fq = write_int4_checkpoint(
        float_model, tmp_path / fmt, fmt, 32, act_order=True
    )
    assert load_hf_config(ckpt).quantization == f"{fmt}-g32-desc_act"
    llm = _llm(ckpt)
    model = llm.engine.runner.model
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
    for i in range(2):
        want = _want_weights(fq, i)
        for key, layer in _linears(model, i).items():
            assert layer.perm.dtype == torch.int32
            assert not torch.equal(layer.perm, torch.arange(layer.perm.numel(), dtype=torch.int32))
            rows = dequantize_q4(layer.qweight, layer.scales, layer.mins)  # inputs in perm order
            restored = torch.empty_like(rows)
            restored[:, layer.perm.long()] = rows
            assert torch.equal(restored, want[key]), (i, key)  # bit for bit, input order
            xin = x[:, : want[key].shape[1]]
            y = layer.quant_method.apply(layer, xin, None)
            torch.testing.assert_close(y, xin @ want[key].t(), rtol=1e-5, atol=1e-5)
    assert _greedy(llm) == _greedy(_llm(float_ckpt))


def test_act_order_parts_of_a_merged_layer_must_share_an_order(
    float_model: Path, tmp_path: Path
) -> None:
    """q, k and v read one input: a k_proj quantized in another order than q_proj cannot be
    merged with it, and is refused naming the tensor."""
    ckpt, _, _ = write_int4_checkpoint(float_model, tmp_path / "g", "gptq", 32, act_order=True)
    tensors = load_file(ckpt / "model.safetensors")
    layer = "model.layers.0.self_attn.k_proj"
    w = load_file(float_model / "model.safetensors")[f"{layer}.weight"]
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(99))
    q = quantize_act_order(w, perm, 32, min_zero=1)
    for leaf, t in pack_gptq(q, 32, v2=False, g_idx=q["g_idx"]).items():
        tensors[f"{layer}.{leaf}"] = t
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"[qk]_proj\.perm .*unlike part \d of the same merged"):
        _llm(ckpt)


def test_act_order_g_idx_with_uneven_groups_is_refused(float_model: Path, tmp_path: Path) -> None:
    ckpt, _, _ = write_int4_checkpoint(float_model, tmp_path / "g", "gptq", 32, act_order=True)
    tensors = load_file(ckpt / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.g_idx"
    tensors[name][:2] = torch.tensor([0, 0], dtype=torch.int32)  # one group gains an input
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError) as info:
        _llm(ckpt)
    message = str(info.value)
    assert f"tensor {name} in {ckpt / 'model.safetensors'}" in message
    assert "must hold group_size (32) inputs" in message


def test_act_order_layers_are_not_split_by_input_over_ranks(
    float_model: Path, tmp_path: Path
) -> None:
    ckpt, _, _ = write_int4_checkpoint(float_model, tmp_path / "g", "gptq", 32, act_order=True)
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        _rank_model(ckpt, 0, 2)


def test_a_layer_missing_its_zeros_is_named(float_model: Path, tmp_path: Path) -> None:
    ckpt, _, _ = write_int4_checkpoint(float_model, tmp_path / "awq", "awq", 32)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.qzeros"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"no checkpoint file holds .*k_proj\.qzeros"):
        _llm(ckpt)


@pytest.mark.parametrize(("packed", "named"), [("gptq", "awq"), ("awq", "gptq")])
def test_a_config_naming_the_other_packing_is_refused_naming_the_layer(
    float_model: Path, tmp_path: Path, packed: str, named: str
) -> None:
    """The refusal quoted an "expected" shape for a layer of the wrong size (taken from the
    misread tensor) and no supported formats."""
    ckpt, _, _ = write_int4_checkpoint(float_model, tmp_path / packed, packed, 32)
    config = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    edit_config(ckpt, quantization_config={**config, "quant_method": named,
                                           **({"version": "gemm", "zero_point": True}
                                              if named == "awq" else {})})  # fmt: skip
    model = json.loads((ckpt / "config.json").read_text())
    layer = f"a {model['intermediate_size']}-input, {model['hidden_size']}-output layer"
    with pytest.raises(ValueError, match=rf"down_proj.qweight .* {layer} \(GPTQ and AWQ pack "
                       r"qweight along different axes.*supported are"):  # fmt: skip
        _llm(ckpt)


def test_int32_tensors_without_an_int4_config_are_refused(
    float_model: Path, tmp_path: Path
) -> None:
    ckpt, _, _ = write_int4_checkpoint(float_model, tmp_path / "gptq", "gptq", 32)
    edit_config(ckpt, quantization_config=None)
    with pytest.raises(ValueError, match=r"dtype torch\.int32.*declares no quantization"):
        _llm(ckpt)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_gpu_kernel_runs_the_repacked_layers(
    float_model: Path, tmp_path: Path, fmt: str, dtype: torch.dtype
) -> None:
    """Every repacked layer through the Triton W4A16 GEMM on CUDA, against its CPU
    dequantized weights in fp32. The kernel rounds each dequantized weight to x's dtype before
    its dot (fp32 accumulation), and the output to x's dtype: tolerances of a few of that
    dtype's steps at outputs of size ~1."""
    ckpt, _, _ = write_int4_checkpoint(float_model, tmp_path / fmt, fmt, 32)
    model = _llm(ckpt).engine.runner.model
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for i in range(2):
        ref = _layer_weights(model, i)
        for key, mod in _linears(model, i).items():
            x = torch.randn(5, ref[key].shape[1], generator=torch.Generator().manual_seed(i))
            x = x.to(dtype)
            mod.to("cuda")
            y = mod(x.cuda()).float().cpu()
            torch.testing.assert_close(y, x.float() @ ref[key].t(), rtol=tol, atol=tol)


@pytest.mark.parametrize("requested", ["none", "int4", "fp8"])
def test_an_int4_checkpoint_runs_as_it_is_whatever_was_asked(requested: str) -> None:
    assert layer_quantization("awq-g64", requested) == "int4_g64"
    assert layer_quantization("gptq-g128-desc_act", requested) == "int4_g128_act"
    assert layer_quantization("none", requested) == requested


@pytest.mark.parametrize("quantization", ["gptq-g32", "gptq-g32-desc_act"])
def test_random_weights_fill_the_int4_layers(float_model: Path, quantization: str) -> None:
    """``load_format: random`` on a GPTQ / AWQ config.json (benchmarks of real shapes); an
    act-order layer's input order is then the identity."""
    config = replace(load_hf_config(float_model), quantization=quantization)
    model = build_model(
        config,
        get_attention_backend("torch", config.num_key_value_heads),
        16,
        torch.device("cpu"),
        torch.float32,
        None,
        quantization=layer_quantization(config.quantization, "none"),
    )
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.uint8 and qkv.qweight.float().std() > 10
    if quantization.endswith("desc_act"):
        assert torch.equal(qkv.perm, torch.arange(64, dtype=torch.int32))


def test_all_zero_biases_of_gptq_layers_are_left_out_and_others_refused(
    float_model: Path, tmp_path: Path
) -> None:
    """Older GPTQ exports write a zero bias for every quantized layer: it changes nothing
    and loads; a bias that is not zero is a layer this architecture does not have."""
    ckpt, _, _ = write_int4_checkpoint(float_model, tmp_path / "gptq", "gptq", 32)
    want = _greedy(_llm(ckpt))
    weights = load_file(ckpt / "model.safetensors")
    for name in [n for n in weights if n.endswith(".qweight")]:
        layer = name.removesuffix(".qweight")
        weights[f"{layer}.bias"] = torch.zeros(weights[f"{layer}.scales"].shape[1]).half()
    save_file(weights, ckpt / "model.safetensors")
    assert _greedy(_llm(ckpt)) == want
    weights["model.layers.1.mlp.down_proj.bias"][3] = 0.5
    save_file(weights, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected weight model\.layers\.1\.mlp\.down_proj"):
        _llm(ckpt)
