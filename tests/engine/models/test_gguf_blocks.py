"""GGUF block tensors run as they are: Q4_0 / Q4_1 as INT4 (W4A16) layers, Q8_0 as INT8
(W8A16) layers. Tiny Llamas converted to GGUF with their linear weights in each type (and
their tokenizer) give the greedy tokens of the same file dequantized at load (CPU, fp32: the
reference path dequantizes to exactly the loader's values); a layer of the wrong type is
refused naming the tensor."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.engine.loader.tiny_gguf import tokenizer_metadata, write_tiny_gguf
from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.loader.gguf_blocks import dequantize_blocks
from tokenmill.kernels.w4a16_gemm import dequantize_q4
from tokenmill.kernels.w8a16_gemm import dequantize_q8, w8a16_linear

METHOD = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("blocks") / "hf")


def _gguf(hf_dir: Path, folder: Path, linear_type: str) -> Path:
    out = folder / f"tiny.{linear_type}.gguf"
    return write_tiny_gguf(hf_dir, out, extra=tokenizer_metadata(hf_dir), linear_type=linear_type)


def _llm(path: Path, quantization: str) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", quantization=quantization,
               kv_cache_memory=1 << 26)  # fmt: skip


def _greedy(llm: LLM) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 260, (4 + i % 7,), generator=g).tolist() for i in range(10)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("linear_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_run_as_they_are_with_the_dequantized_tokens(
    hf_dir: Path, tmp_path: Path, linear_type: str
) -> None:
    path = _gguf(hf_dir, tmp_path, linear_type)
    blocks, dequantized = _llm(path, METHOD[linear_type]), _llm(path, "none")
    layer = blocks.engine.runner.model.model.layers[1].mlp.down_proj
    assert not hasattr(layer, "weight")
    if linear_type == "Q8_0":
        assert layer.qweight.dtype == torch.int8 and layer.qweight.shape == (64, 128)
        w = dequantize_q8(layer.qweight, layer.scales)
    else:
        assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (64, 64)
        w = dequantize_q4(layer.qweight, layer.scales, layer.mins)
    assert layer.scales.shape == (64, 128 // 32)
    want = dequantized.engine.runner.model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(w, want)  # the loader's values, bit for bit
    assert _greedy(blocks) == _greedy(dequantized)


def test_the_w8a16_kernel_runs_a_loaded_layer_in_the_interpreter(
    hf_dir: Path, tmp_path: Path
) -> None:
    llm = _llm(_gguf(hf_dir, tmp_path, "Q8_0"), "int8")
    layer = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    want = x @ dequantize_q8(layer.qweight, layer.scales).t()
    torch.testing.assert_close(w8a16_linear(x, layer.qweight, layer.scales), want)


@pytest.mark.parametrize(("linear_type", "asked"), [("Q4_1", "int8"), ("Q8_0", "int4")])
def test_a_method_refuses_another_block_type_naming_the_tensor(
    hf_dir: Path, tmp_path: Path, linear_type: str, asked: str
) -> None:
    path = _gguf(hf_dir, tmp_path, linear_type)
    with pytest.raises(ValueError, match=rf"GGUF tensor blk\.0\.\w+\.weight in .* is {linear_type}"
                       rf"; quantization {asked} runs"):  # fmt: skip
        _llm(path, asked)


def test_int8_needs_a_gguf_file(hf_dir: Path) -> None:
    with pytest.raises(ValueError, match="int8 runs the Q8_0 blocks of a GGUF file"):
        _llm(hf_dir, "int8")


@pytest.mark.parametrize("linear_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_dequantizing_blocks_equals_the_gguf_package(linear_type: str) -> None:
    kind = gguf.GGMLQuantizationType[linear_type]
    w = np.random.default_rng(0).standard_normal((6, 256)).astype(np.float32)
    data = gguf.quants.quantize(w, kind)
    want = gguf.quants.dequantize(data, kind)
    assert np.array_equal(dequantize_blocks(data, linear_type, 6), want)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_gpu_smollm2_runs_its_blocks_in_cuda_graphs(quantization: str, tmp_path: Path) -> None:
    """On the GPU the W4A16 kernel runs the embedded model's Q4_1 blocks and the W8A16 kernel
    a Q8_0 copy of it: graphs and eager agree, and the rows match the same file dequantized.
    In fp32, where the kernel's dots are exact fp32 and only the order of the sums differs
    from cuBLAS's (in bf16 that order alone turned 5 of 16 greedy rows, on an H200)."""
    from bench.gguf_requantize import requantize
    from bench.prompts import chat_prompts

    path = "smollm2-135m-instruct"
    if quantization == "int8":
        path = str(requantize(path, tmp_path / "smollm2.Q8_0.gguf", "Q8_0"))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    convs = chat_prompts(16)
    outs = {}
    for method, graphs in (("none", True), (quantization, False), (quantization, True)):
        llm = LLM(path, device="cuda", dtype="float32", quantization=method, cuda_graphs=graphs)
        outs[(method, graphs)] = [o.token_ids for o in llm.chat(convs, params)]
        del llm
        torch.cuda.empty_cache()
    assert outs[(quantization, True)] == outs[(quantization, False)]
    pairs = zip(outs[(quantization, True)], outs[("none", True)], strict=True)
    same = sum(a == b for a, b in pairs)
    assert same >= 15, same  # one near-tie may still turn


def test_the_start_up_line_says_what_the_linear_layers_hold(
    hf_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _gguf(hf_dir, tmp_path, "Q8_0")
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.llm_engine"):
        _llm(path, "none")
        _llm(path, "int8")
    ready = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    dequantized = "the file's Q8_0 weights dequantized at load; quantization int8 runs them"
    assert f"linear layers float32 ({dequantized} as they are)" in ready[0]
    assert "linear layers int8 (the file's Q8_0 blocks as they are)" in ready[1]
