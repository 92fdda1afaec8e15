"""quantize_rows_fp8 (Triton) against quantize_rows, its torch reference: the same e4m3 values
and the same scales, exactly (no tolerance: both divide in IEEE fp32 and round to nearest
even), on CPU through the interpreter and on CUDA at Llama-3-8B widths."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.models.fp8 import Fp8Method
from tokenmill.engine.models.linear import RowParallelLinear
from tokenmill.kernels.fp8_quant import quantize_rows_fp8, quantize_rows_fp8_ref
from tokenmill.kernels.fp8_rows import FP8_MAX, MIN_SCALE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(t: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[t, k] random rows whose magnitudes span many binades, with the awkward rows first:
    all zeros, amax exactly 448 (scale 1: values reach the cast as they are, ties and
    subnormals included), tiny (the 1e-12 scale floor), huge."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.exp2(torch.randint(-8, 8, (t, 1), generator=g))
    special = [
        torch.zeros(k),
        FP8_MAX * torch.exp2(-14 * torch.rand(k, generator=g)) * torch.randn(k, generator=g).sign(),
        torch.randn(k, generator=g) * 1e-10,
        torch.randn(k, generator=g) * 2e3,  # finite in fp16 too
    ]
    special[1][0] = FP8_MAX
    special[1][1:8] = torch.tensor([31.5, -17.0, 19.0, 232.0, 1.5 * 2**-9, -(2**-11), -0.0])
    for i, row in enumerate(special[: max(0, t - 1)]):  # keep one plain random row
        x[i] = row
    return x.to(dtype)


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]):
    (q, scale), (q_ref, scale_ref) = got, want
    assert q.dtype == torch.float8_e4m3fn and q.shape == q_ref.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == scale_ref.shape
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())  # -0 == +0; every other bit pattern equal


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("t", "k", "block_k"),
    [
        (1, 64, None),  # one decode row
        (3, 200, None),  # K not a power of two: one masked tile
        (17, 1024, None),  # rows packed four to a program, the last program partly empty
        (5, 200, 64),  # the two-pass loop over K, last chunk partly masked
        (17, 64, 16),  # the loop with several rows a program
    ],
)
def test_matches_reference(t: int, k: int, block_k: int | None, dtype: torch.dtype) -> None:
    x = _rows(t, k, dtype, seed=t * k).to(DEVICE)
    _assert_same(quantize_rows_fp8(x, block_k=block_k), quantize_rows_fp8_ref(x))


def test_edge_values_round_like_torch() -> None:
    # scale 1 (amax 448): a carry into the exponent, ties to even, subnormals, signed zeros
    x = _rows(3, 64, torch.float32)[1:2].to(DEVICE)
    q, scale = quantize_rows_fp8(x)
    assert scale.item() == 1.0
    assert q[0, :8].float().tolist() == [448.0, 32.0, -16.0, 20.0, 224.0, 2**-8, -0.0, 0.0]
    _assert_same((q, scale), quantize_rows_fp8_ref(x))


def test_float16_strided_rows_and_the_scale_floor() -> None:
    x = _rows(6, 96, torch.float16, seed=3).to(DEVICE)[::2, 8:72]  # [3, 64], row stride 192
    q, scale = quantize_rows_fp8(x)
    _assert_same((q, scale), quantize_rows_fp8_ref(x))
    assert scale[0].item() == pytest.approx(MIN_SCALE)  # the zero row


def test_no_tokens_launches_nothing() -> None:
    q, scale = quantize_rows_fp8(torch.empty(0, 4096, dtype=torch.bfloat16, device=DEVICE))
    assert q.shape == (0, 4096) and q.dtype == torch.float8_e4m3fn
    assert scale.shape == (0, 1) and scale.dtype == torch.float32


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        quantize_rows_fp8(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="dtype"):
        quantize_rows_fp8(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="K == 0"):
        quantize_rows_fp8(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="power of two"):
        quantize_rows_fp8(torch.zeros(2, 64), block_k=48)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336])
@pytest.mark.parametrize("t", [1, 4, 16, 333, 2048, 4096])
def test_llama8b_widths_gpu(t: int, k: int) -> None:
    x = _rows(t, k, torch.bfloat16, seed=t).cuda()
    _assert_same(quantize_rows_fp8(x), quantize_rows_fp8_ref(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_and_the_loop_gpu(dtype: torch.dtype) -> None:
    x = _rows(77, 20000, dtype).cuda()  # past the one-tile width: the two-pass loop
    _assert_same(quantize_rows_fp8(x), quantize_rows_fp8_ref(x))


@pytest.mark.gpu
def test_captures_in_a_cuda_graph_gpu() -> None:
    x = _rows(64, 4096, torch.bfloat16).cuda()
    quantize_rows_fp8(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scale = quantize_rows_fp8(x)
    x.copy_(_rows(64, 4096, torch.bfloat16, seed=1).cuda())
    graph.replay()
    torch.cuda.synchronize()
    _assert_same((q, scale), quantize_rows_fp8_ref(x))


@pytest.mark.gpu
def test_layer_quantizes_with_the_kernel_gpu() -> None:
    layer = RowParallelLinear(4096, 1024, quant_method=Fp8Method(), params_dtype=torch.bfloat16)
    layer.weight = torch.nn.Parameter(
        torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16) * 0.02, requires_grad=False
    )
    layer.quant_method.process_weights_after_loading(layer)
    x = _rows(100, 4096, torch.bfloat16).cuda()
    x_q, x_scale = quantize_rows_fp8_ref(x)
    want = torch._scaled_mm(x_q, layer.weight, scale_a=x_scale, scale_b=layer.weight_scale,
                            out_dtype=torch.bfloat16)  # fmt: skip
    assert torch.equal(layer(x), want)  # the same quantized operands, the same GEMM
