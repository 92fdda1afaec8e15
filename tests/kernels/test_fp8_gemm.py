"""fp8_gemm (Triton) against fp8_gemm_ref, and against the FP8 layer's own arithmetic."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.models.fp8 import TRITON_MAX_ROWS, takes_triton_gemm
from tokenmill.kernels.fp8_gemm import choose_fp8_tiles, fp8_gemm, fp8_gemm_ref
from tokenmill.kernels.fp8_rows import quantize_rows
from tokenmill.kernels.int_weight_tiles import IntGemmTiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# e4m3 products are exact in fp32; the interpreter sums them in fp32, Hopper's FP8 tensor
# cores in an accumulator of fewer bits (about 14 mantissa bits, as DeepSeek-V3 reports).
FP32_TOL = dict(rtol=1e-5, atol=1e-5) if DEVICE == "cpu" else dict(rtol=5e-3, atol=2e-3)
TOL = {torch.float32: FP32_TOL, torch.bfloat16: {}}


def _operands(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x_q, x_scale = quantize_rows(torch.randn(m, k, generator=g) * 3)  # [M, K], [M, 1]
    w_q, w_scale = quantize_rows(torch.randn(n, k, generator=g) * 0.02)  # [N, K], [N, 1]
    dev = [t.to(DEVICE) for t in (x_q, x_scale, w_q, w_scale.t().contiguous())]
    return dev  # w_scale as the layer keeps it: [1, N]


@pytest.mark.parametrize(
    ("m", "n", "k", "tiles"),
    [
        (5, 96, 256, None),  # the default tiles: rows and columns past the ends masked
        (3, 64, 512, IntGemmTiles(16, 32, 64, 4)),  # split-K: four K runs summed in order
        (70, 40, 128, IntGemmTiles(64, 32, 32, 2)),  # two row tiles, a ragged column tile
    ],
)
def test_matches_reference(m: int, n: int, k: int, tiles: IntGemmTiles | None) -> None:
    x_q, x_scale, w_q, w_scale = _operands(m, n, k)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = fp8_gemm(x_q, x_scale, w_q, w_scale, out_dtype, tiles=tiles)
        want = fp8_gemm_ref(x_q, x_scale, w_q, w_scale, out_dtype)
        assert got.shape == (m, n) and got.dtype == out_dtype
        torch.testing.assert_close(got, want, **TOL[out_dtype])


def test_the_layer_view_and_scaled_mm_agree() -> None:
    """The FP8 layer keeps weight [K, N] (a view) and scale [1, N]: its transpose is w_q,
    and on CPU ``torch._scaled_mm``'s arithmetic is the reference's."""
    x_q, x_scale, w_q, w_scale = _operands(4, 48, 96)
    layer_weight = w_q.t()  # [K, N] column-major, as _scaled_mm takes it
    got = fp8_gemm(x_q, x_scale, layer_weight.t(), w_scale, torch.float32)
    want = fp8_gemm_ref(x_q, x_scale, w_q, w_scale, torch.float32)
    torch.testing.assert_close(got, want, **FP32_TOL)


def test_default_tiles_are_the_h200_sweeps_best_and_fit_k() -> None:
    """64 x 64 tiles without split-K; K runs of 256 at decode-sized M, 128 beyond; a K that
    256 does not divide takes the longest run that does."""
    t = choose_fp8_tiles(16, 6144, 4096)
    assert (t.block_m, t.block_n, t.block_k, t.split_k) == (64, 64, 256, 1)
    t = choose_fp8_tiles(256, 6144, 4096)
    assert (t.block_m, t.block_n, t.block_k, t.split_k) == (64, 64, 128, 1)
    assert choose_fp8_tiles(16, 64, 96).block_k == 32


def test_refuses_wrong_inputs() -> None:
    x_q, x_scale, w_q, w_scale = _operands(2, 32, 64)
    with pytest.raises(ValueError, match="share K"):
        fp8_gemm(x_q, x_scale, w_q[:, :32], w_scale)
    with pytest.raises(ValueError, match="float8"):
        fp8_gemm(x_q.float(), x_scale, w_q, w_scale)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_gemm(x_q, x_scale, w_q, w_scale[:, :5])
    # K = 48: the K loop's 32-wide tiles would read 16 values past each row (the next row's:
    # wrong sums, with no error). _scaled_mm takes such a K, and the layer sends it there.
    x_q, x_scale, w_q, w_scale = _operands(1, 8, 48)
    with pytest.raises(ValueError, match="K=48 must be a multiple of 32"):
        fp8_gemm(x_q, x_scale, w_q, w_scale)
    assert not takes_triton_gemm(1, 48) and not takes_triton_gemm(1, 80)
    assert takes_triton_gemm(TRITON_MAX_ROWS, 64) and not takes_triton_gemm(TRITON_MAX_ROWS + 1, 64)
