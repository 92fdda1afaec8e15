"""silu_and_mul (Triton) against silu_and_mul_ref over shapes, dtypes and strided rows; and
silu_and_mul_fp8, the same product written as FP8 rows, against quantize_rows of it."""

from __future__ import annotations

import pytest
import torch

from tests.devices import gpu_also
from tests.kernels.fp8_row_checks import assert_fp8_rows_of
from tokenmill.engine.models.layers import silu_and_mul as engine_silu_and_mul
from tokenmill.kernels.fp8_rows import MIN_SCALE
from tokenmill.kernels.silu_and_mul import (
    silu_and_mul,
    silu_and_mul_fp8,
    silu_and_mul_fp8_ref,
    silu_and_mul_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Kernel and reference both compute in fp32 and round once; they differ only by the fp32
# exp/division rounding, so low precision dtypes can be off by one ulp near a rounding
# boundary (fp16 2^-11 relative; bf16 up to 2^-7, with room for a second ulp because
# Triton's interpreter truncates fp32 -> bf16 where the GPU rounds to nearest), fp32 by a
# few ulps.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def _x(t: int, inter: int, dtype: torch.dtype, pad: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(t * 7 + inter)
    wide = (3 * torch.randn(t, 2 * inter + pad, generator=gen)).to(DEVICE, dtype)
    return wide[:, : 2 * inter]  # [T, 2I], row stride 2I + pad when pad > 0


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(("t", "inter", "pad"), [(3, 1536, 0), (2, 100, 0), (4, 192, 40)])
def test_silu_and_mul_matches_ref(t, inter, pad, dtype) -> None:
    x = _x(t, inter, dtype, pad)
    x_before = x.clone()
    y = silu_and_mul(x)
    assert y.shape == (t, inter) and y.dtype == dtype
    torch.testing.assert_close(y, silu_and_mul_ref(x), **TOL[dtype])
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)  # input untouched


def test_silu_and_mul_out_and_engine() -> None:
    x = _x(2, 256, torch.float32)
    out = torch.empty(2, 256, device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    # fp32: the engine's torch path is the same math.
    torch.testing.assert_close(out, engine_silu_and_mul(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul(x, out=torch.empty(2, 255, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [14336, 1536])
def test_silu_and_mul_engine_size(inter, dtype) -> None:
    x = _x(4096, inter, dtype)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOL[dtype])


# silu_and_mul_fp8: exact, no tolerance. Its y is silu_and_mul's y (the same element-wise
# formula), and q / scale are quantize_rows of that rounded y, in the interpreter too.


@pytest.mark.parametrize("dtype", [torch.float32, *map(gpu_also, [torch.float16, torch.bfloat16])])
@pytest.mark.parametrize(
    ("t", "inter", "pad", "path"),
    [
        (3, 1536, 0, {}),  # one tile a row
        (2, 100, 0, {}),  # I not a power of two: a masked tile
        (17, 192, 40, {}),  # strided rows, 16 a program, the second program ragged
        (5, 200, 0, {"block": 64}),  # the two loops over I, the last chunk masked
        (17, 64, 0, {"block": 16}),  # the loops with several rows a program
        (5, 200, 0, {"split_columns": 64}),  # columns over programs, the last chunk masked
        (17, 192, 40, {"split_columns": 32}),  # strided rows, six chunks (eight slots)
        (3, 100, 0, {"split_columns": 4096}),  # a chunk wider than I: one a row
        (2, 5000, 0, {"block": 8192}),  # one tile where the default splits the columns
    ],
)
def test_silu_and_mul_fp8_is_quantize_rows_of_the_product(t, inter, pad, path, dtype) -> None:
    x = _x(t, inter, dtype, pad)
    x[0] = 0  # an all-zero row: the 1e-12 scale floor
    y = torch.empty(t, inter, dtype=dtype, device=DEVICE)
    q, scale = silu_and_mul_fp8(x, out=y, **path)
    assert torch.equal(y, silu_and_mul(x))
    assert_fp8_rows_of(q, scale, y)
    assert scale[0].item() == pytest.approx(MIN_SCALE)
    q_alone, scale_alone = silu_and_mul_fp8(x, **path)  # y never written
    assert torch.equal(q_alone.float(), q.float()) and torch.equal(scale_alone, scale)
    q_default, scale_default = silu_and_mul_fp8(x)  # every path gives the same bits
    assert torch.equal(q_default.float(), q.float()) and torch.equal(scale_default, scale)
    # The torch path's y may be an ulp off (see TOL), so a value one e4m3 step (1/8) away.
    q_ref, scale_ref = silu_and_mul_fp8_ref(x)
    torch.testing.assert_close(
        q.float() * scale, q_ref.float() * scale_ref, rtol=0.13, atol=scale.max().item() / 512
    )


def test_silu_and_mul_fp8_no_tokens_and_bad_inputs() -> None:
    q, scale = silu_and_mul_fp8(torch.empty(0, 64, device=DEVICE))
    assert q.shape == (0, 32) and scale.shape == (0, 1)
    with pytest.raises(ValueError, match="I == 0"):
        silu_and_mul_fp8(torch.empty(2, 0, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        silu_and_mul_fp8(torch.zeros(2, 64, device=DEVICE), block=24)
    with pytest.raises(ValueError, match="split_columns must be a power of two"):
        silu_and_mul_fp8(torch.zeros(2, 64, device=DEVICE), split_columns=0)
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul_fp8(torch.zeros(2, 64, device=DEVICE), out=torch.empty(2, 31))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("inter", "path"),
    [
        (14336, {}),  # the default: the column split, 1,024 columns a program
        (14336, {"block": 16384}),  # one tile
        (14336, {"block": 2048}),  # the two loops
        (14336, {"split_columns": 2048}),
        (1536, {}),  # one tile
    ],
)
@pytest.mark.parametrize("t", [1, 333, 2048])
def test_silu_and_mul_fp8_llama8b_width_gpu(t, inter, path, dtype) -> None:
    """Llama-3-8B's 14336 (the column split, one tile, the loops) and SmolLM2's 1536:
    exactly the torch path's FP8 rows, as the kernel's y is torch's bit for bit on the GPU."""
    x = _x(t, inter, dtype)
    y = torch.empty(t, inter, dtype=dtype, device=DEVICE)
    q, scale = silu_and_mul_fp8(x, out=y, **path)
    assert torch.equal(y, silu_and_mul(x))
    assert_fp8_rows_of(q, scale, y)
    q_ref, scale_ref = silu_and_mul_fp8_ref(x)
    assert torch.equal(scale, scale_ref) and torch.equal(q.float(), q_ref.float())


@pytest.mark.gpu
def test_silu_and_mul_fp8_captures_in_a_cuda_graph_gpu() -> None:
    x = _x(64, 14336, torch.bfloat16)
    silu_and_mul_fp8(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scale = silu_and_mul_fp8(x)
    x.copy_(_x(64, 14336, torch.bfloat16).flip(0))  # new rows in the captured buffer
    graph.replay()
    torch.cuda.synchronize()
    assert_fp8_rows_of(q, scale, silu_and_mul(x))
