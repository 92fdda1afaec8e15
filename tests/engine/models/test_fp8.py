"""FP8 W8A8 linear layers: per-channel e4m3 weights, per-token activations, one scaled matmul;
against the same arithmetic written out, against the exact product, and through a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.models.fp8 import FP8_MAX, Fp8Method, fp8_linear_reference, quantize_rows
from tokenmill.engine.models.linear import MergedColumnParallelLinear, RowParallelLinear
from tokenmill.jobs.cli import main as cli_main
from tokenmill.jobs.spec import JobSpec


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


@pytest.mark.gpu
def test_gpu_fp8_layers_and_a_model_in_cuda_graphs(tmp_path: Path) -> None:
    """On the GPU: _scaled_mm's fp8 tensor-core product equals the written-out arithmetic
    (bf16 output), and a model runs in fp8 through CUDA graphs like it does eagerly."""
    layer = RowParallelLinear(256, 128, quant_method=Fp8Method(), params_dtype=torch.bfloat16)
    w = torch.randn(128, 256, dtype=torch.bfloat16, device="cuda")
    layer = layer.cuda()
    layer.weight.data.copy_(w)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(40, 256, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(layer(x).float(), fp8_linear_reference(x, w), rtol=2e-2, atol=0.1)
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
