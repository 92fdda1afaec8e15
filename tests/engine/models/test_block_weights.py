"""The weight-only integer methods' forward (block_weights.py): on CUDA the W4A16 / W8A16
kernel below their LARGE_M tokens and dequantize + a 16-bit GEMM from there on; each against
the dequantized weight's product."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.models.int4 import Int4Method
from tokenmill.engine.models.int8 import Int8Method
from tokenmill.kernels.w4a16_gemm import dequantize_q4, pack_q4
from tokenmill.kernels.w8a16_gemm import dequantize_q8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IN, OUT = 512, 384


def _layer(method, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    layer = torch.nn.Module()
    method.create_weights(layer, IN, [OUT], torch.bfloat16, lambda *a, **k: None)
    for name, value in params.items():
        getattr(layer, name).data = value.to(DEVICE)
    return layer


def _int4() -> tuple[Int4Method, dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    scales = (torch.rand(OUT, IN // 32, generator=g) * 0.02 + 0.001).half()
    params = {
        "qweight": pack_q4(torch.randint(0, 16, (OUT, IN), generator=g)),
        "scales": scales,
        "mins": (-8 * scales.float()).half(),
    }
    return Int4Method(), params, dequantize_q4(*params.values())


def _int8() -> tuple[Int8Method, dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    params = {
        "qweight": torch.randint(-128, 128, (OUT, IN), generator=g).to(torch.int8),
        "scales": (torch.rand(OUT, IN // 32, generator=g) * 0.002 + 0.0001).half(),
    }
    return Int8Method(), params, dequantize_q8(*params.values())


@pytest.mark.parametrize("make", [_int4, _int8], ids=["int4", "int8"])
@pytest.mark.parametrize("m", [1, 16, 63, 64, 300])
def test_forward_matches_the_dequantized_weight(make, m: int) -> None:
    """Both sides of LARGE_M (64): same product as F.linear on the bf16 weight."""
    method, params, weight = make()
    layer = _layer(method, params)
    x = torch.randn(m, IN, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.bfloat16)
    y = method.apply(layer, x, None)
    want = torch.nn.functional.linear(x.float(), weight.to(DEVICE)).to(torch.bfloat16)
    assert y.shape == (m, OUT) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_random_weights_run_in_the_integer_methods(tmp_path, quantization: str) -> None:
    """``load_format: random`` with GGUF-block layers (benchmarks of real shapes without a
    file): INT8's signed codes, like INT4's packed bytes, fill their whole range."""
    from tests.tiny_models import save_tiny_model
    from tokenmill import LLM, SamplingParams

    model = save_tiny_model("llama", tmp_path / "m", max_position_embeddings=64)
    llm = LLM(str(model), device="cpu", load_format="random", quantization=quantization)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    codes = qkv.qweight.int()
    assert codes.min() < (-100 if quantization == "int8" else 20) and codes.max() > 100
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
