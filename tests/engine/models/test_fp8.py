"""FP8 W8A8 linear layers: per-channel e4m3 weights, per-token activations, one scaled matmul;
against the same arithmetic written out, against the exact product, and through a model; and
the producers (norms, SiLU-and-mul) that hand an FP8 layer its input already quantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.attention.backend import get_attention_backend
from tokenmill.engine.attention.metadata import CommonAttentionMetadata
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.model_loader import build_model
from tokenmill.engine.models.fp8 import (
    FP8_MAX,
    TRITON_MAX_ROWS,
    Fp8Method,
    fp8_linear_reference,
    quantize_rows,
)
from tokenmill.engine.models.fp8_activation import QuantizedActivation
from tokenmill.engine.models.layers import RMSNorm, silu_and_mul
from tokenmill.engine.models.linear import MergedColumnParallelLinear, RowParallelLinear
from tokenmill.jobs.cli import main as cli_main
from tokenmill.jobs.spec import JobSpec
from tokenmill.kernels.fp8_gemm import fp8_gemm


def test_rows_quantize_to_their_own_scale() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 1e-3, -7.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 1)
    assert torch.allclose(scale[:, 0], torch.tensor([2.0, 0.0, 300.0]) / FP8_MAX, atol=1e-12)
    assert q.float().abs().amax(dim=1).tolist()[0::2] == [FP8_MAX, FP8_MAX]  # each row's max
    assert not q.float()[1].any()  # an all-zero row stays zero (no 0 / 0)
    # e4m3 keeps 3 mantissa bits: every value within 1/16 of itself, relative
    back = q.float() * scale
    big = x.abs() > scale * 2**-6  # normal e4m3 numbers
    assert ((back - x).abs()[big] <= x.abs()[big] / 16).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["merged", "row"])
def test_layer_matches_the_written_out_arithmetic(dtype: torch.dtype, kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    if kind == "merged":
        layer = MergedColumnParallelLinear(64, (32, 16), bias=True, quant_method=Fp8Method(),
                                           params_dtype=dtype)  # fmt: skip
    else:
        layer = RowParallelLinear(64, 48, bias=True, quant_method=Fp8Method(), params_dtype=dtype)
    w = torch.randn(48, 64, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.shape == (64, 48)
    x = torch.randn(7, 64, generator=g).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (7, 48)
    ref = fp8_linear_reference(x, w, b)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=8e-2)
    torch.testing.assert_close(y.float(), ref, **tol)
    exact = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert (ref - exact).norm() / exact.norm() < 0.06  # e4m3 on both sides: a few percent


def test_a_model_runs_in_fp8_close_to_its_float_self(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path / "m")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 280, (8 + i % 7,), generator=g).tolist() for i in range(60)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = {}
    for quantization in ("none", "fp8"):
        llm = LLM(str(path), device="cpu", dtype="float32", quantization=quantization,
                  kv_cache_memory=1 << 26)  # fmt: skip
        outs[quantization] = [o.token_ids for o in llm.generate(prompts, params)]
    layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.float8_e4m3fn
    # A random tiny model's logits are nearly flat (top token ~ -4.7 nats of ~300), so ties
    # flip under a few percent of error; most first tokens still agree.
    same = sum(a[0] == b[0] for a, b in zip(outs["none"], outs["fp8"], strict=True))
    assert same >= 45, same


def test_job_yaml_quantization(tmp_path: Path, capsys) -> None:
    raw = {"model": {"source": "m", "quantization": "fp8"}, "input": {"path": "in.jsonl"},
           "output": {"path": "out/"}}  # fmt: skip
    assert JobSpec.from_dict(raw).model.quantization == "fp8"
    raw["model"]["quantization"] = "int3"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    assert cli_main([str(job)]) == 2
    assert "model.quantization" in capsys.readouterr().err


def _tiny_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _prefill_hidden(model: torch.nn.Module, tokens: int) -> torch.Tensor:
    """The model's hidden states [T, hidden] for one fresh prompt of ``tokens`` tokens, on a
    zeroed paged KV cache (blocks of 16, in order)."""
    config, block = model.config, 16
    backend = model.model.layers[0].self_attn.backend
    weight = model.model.embed_tokens.weight  # the model's dtype and device
    on = {"device": weight.device}
    blocks = -(-tokens // block)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, **on),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, **on),
        block_tables=torch.arange(blocks, dtype=torch.int32, **on)[None],
        slot_mapping=torch.arange(tokens, **on),
        query_lens_host=np.array([tokens]),
        seq_lens_host=np.array([tokens]),
        block_size=block,
        num_decodes=0,
    )
    shape = backend.kv_cache_shape(blocks, block, config.num_key_value_heads, config.head_dim)
    caches = [torch.zeros(shape, dtype=weight.dtype, **on) for _ in range(config.num_hidden_layers)]
    ids = torch.randint(0, config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return model(ids.to(**on), torch.arange(tokens, **on), caches, backend.build(common))


@pytest.mark.parametrize(
    ("backend_name", "device"),
    [
        ("torch", "cpu"),
        ("triton", "cpu"),  # the kernels in the interpreter
        pytest.param("triton", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_producers_quantize_for_fp8_layers_with_the_same_bits(
    backend_name: str, device: str
) -> None:
    """The norms before qkv and gate_up, and SiLU-and-mul before down, hand their FP8 layer
    e4m3 rows (fused kernels with the triton backend, torch plus quantize_rows with the
    torch one); o_proj, after attention, quantizes its own. Hidden states are bit for bit
    those of the same model with every layer quantizing its own input."""
    config = _tiny_config()
    backend = get_attention_backend(backend_name, config.num_key_value_heads)
    backend.set_engine_limits(64, 8, torch.device(device))
    model = build_model(config, backend, 64, torch.device(device), torch.bfloat16, None,
                        quantization="fp8")  # fmt: skip
    layers = model.model.layers
    inputs: dict[str, type] = {}
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        layers[0].get_submodule(name).register_forward_pre_hook(
            lambda _m, args, name=name: inputs.__setitem__(name, type(args[0]))
        )
    fused = _prefill_hidden(model, 21)
    assert inputs == {
        "self_attn.qkv_proj": QuantizedActivation,
        "self_attn.o_proj": torch.Tensor,
        "mlp.gate_up_proj": QuantizedActivation,
        "mlp.down_proj": QuantizedActivation,
    }
    for layer in layers:  # every FP8 layer quantizes its own input, as before the seam
        layer.input_layernorm.fp8_out = layer.post_attention_layernorm.fp8_out = False
        layer.mlp.act_fp8_out = False
    unfused = _prefill_hidden(model, 21)
    assert inputs["mlp.down_proj"] is torch.Tensor
    assert fused.dtype == torch.bfloat16 and torch.isfinite(fused).all()
    assert torch.equal(fused, unfused)


def test_only_fp8_layers_get_quantized_inputs() -> None:
    config = _tiny_config()
    backend = get_attention_backend("torch", config.num_key_value_heads)
    for quantization, fp8 in (("none", False), ("fp8", True), ("int4", False)):
        model = build_model(config, backend, 64, torch.device("cpu"), torch.float32, None,
                            quantization=quantization)  # fmt: skip
        layer = model.model.layers[0]
        assert layer.input_layernorm.fp8_out is fp8
        assert layer.post_attention_layernorm.fp8_out is fp8
        assert layer.mlp.act_fp8_out is fp8
        assert model.model.norm.fp8_out is False  # the LM head stays in the model's dtype


@pytest.mark.parametrize("fused", [False, True])  # True: the kernels, in the interpreter
def test_producer_outputs_are_quantize_rows_of_their_float_outputs(fused: bool) -> None:
    g = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(9, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    weight = 1 + 0.1 * torch.randn(64, generator=g)
    norm, norm_fp8 = RMSNorm(64, 1e-6, fused), RMSNorm(64, 1e-6, fused, fp8_out=True)
    with torch.no_grad():
        for n in (norm, norm_fp8):
            n.weight.copy_(weight)
            n.to(torch.bfloat16)
    y, s = norm(x, residual.clone())
    a, s_fp8 = norm_fp8(x, residual.clone())
    assert torch.equal(s_fp8, s)
    for got, want in ((a, y), (norm_fp8(x), norm(x))):
        q, scale = quantize_rows(want)
        assert torch.equal(got.values.float(), q.float()) and torch.equal(got.scales, scale)
    gate_up = 3 * torch.randn(9, 2 * 48, generator=g).to(torch.bfloat16)
    got = silu_and_mul(gate_up, fused, fp8_out=True)
    q, scale = quantize_rows(silu_and_mul(gate_up, fused))
    assert torch.equal(got.values.float(), q.float()) and torch.equal(got.scales, scale)


@pytest.mark.gpu
def test_gpu_fp8_layers_and_a_model_in_cuda_graphs(tmp_path: Path) -> None:
    """On the GPU: the layer's product equals the written-out arithmetic (bf16 output) on
    both of its paths: up to TRITON_MAX_ROWS rows the Triton kernel's own bits, past it
    _scaled_mm's; and a model runs in fp8 through CUDA graphs like it does eagerly."""
    layer = RowParallelLinear(256, 128, quant_method=Fp8Method(), params_dtype=torch.bfloat16)
    w = torch.randn(128, 256, dtype=torch.bfloat16, device="cuda")
    layer = layer.cuda()
    layer.weight.data.copy_(w)
    layer.quant_method.process_weights_after_loading(layer)
    for rows in (1, 40, TRITON_MAX_ROWS, TRITON_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 256, dtype=torch.bfloat16, device="cuda")
        got = layer(x)
        torch.testing.assert_close(got.float(), fp8_linear_reference(x, w), rtol=2e-2, atol=0.1)
        x_q, x_scale = quantize_rows(x)
        w_scale = layer.weight_scale
        if rows <= TRITON_MAX_ROWS:
            want = fp8_gemm(x_q, x_scale, layer.weight.t(), w_scale, torch.bfloat16)
        else:
            want = torch._scaled_mm(x_q, layer.weight, x_scale, w_scale, out_dtype=torch.bfloat16)
        assert torch.equal(got, want), rows
    path = save_tiny_model("llama", tmp_path / "m")
    prompts = [[5 + i, 9, 17, 33 + i] for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", quantization="fp8",
                  cuda_graphs=graphs, max_num_seqs=8)  # fmt: skip
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
