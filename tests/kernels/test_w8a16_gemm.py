"""w8a16_linear (Triton) against w8a16_linear_ref, and the q8-rows layout."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.int_weight_tilings import TILINGS
from tokenmill.kernels.int_weight_tiles import IntGemmTiles
from tokenmill.kernels.w8a16_gemm import dequantize_q8, w8a16_linear, w8a16_linear_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Both accumulate in fp32 and round once; the kernel rounds each dequantized weight to x's
# dtype before its dot on the GPU (a 16-bit weight, as a 16-bit GEMM would hold it).
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-4),
    torch.float16: dict(rtol=4e-3, atol=4e-2),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-1),
}


def _weights(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    scales = (torch.rand(n, k // group, generator=g) * 0.002 + 0.0001).half()
    return codes, scales


def test_dequantizes_each_group_with_its_scale() -> None:
    codes, scales = _weights(3, 96, 32)
    w = dequantize_q8(codes, scales)
    assert w[2, 40] == codes[2, 40].float() * scales[2, 1].float()
    assert torch.equal(w, codes.float() * scales.float().repeat_interleave(32, 1))


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "dtype"),
    [
        (1, 64, 64, 32, torch.float32),  # one decode row
        (5, 48, 96, 32, torch.float16),  # N not a multiple of the tile, K not of 64
        (17, 64, 128, 64, torch.bfloat16),  # two M tiles, groups of 64
        (3, 32, 256, 128, torch.float32),  # larger groups
    ],
)
def test_matches_reference(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> None:
    qweight, scales = _weights(n, k, group, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = [t.to(DEVICE) for t in (x, qweight, scales)]
    y = w8a16_linear(*args)
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y.float(), w8a16_linear_ref(*args).float(), **TOL[dtype])


@pytest.mark.parametrize(("tiles", "group"), TILINGS)
def test_tilings_match_reference(tiles: IntGemmTiles, group: int) -> None:
    """Every tiling computes the same product; fp32 inputs, so within fp32 rounding of the
    reference."""
    m, n, k = 3, 40, 512
    qweight, scales = _weights(n, k, group, seed=group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    args = [t.to(DEVICE) for t in (x, qweight, scales)]
    y = w8a16_linear(*args, tiles=tiles)
    torch.testing.assert_close(y, w8a16_linear_ref(*args), **TOL[torch.float32])


def test_rejects_bad_shapes() -> None:
    qweight, scales = _weights(8, 64, 32)
    with pytest.raises(ValueError, match="int8"):
        w8a16_linear(torch.randn(2, 64), qweight.to(torch.uint8), scales)
    with pytest.raises(ValueError, match=r"K=48 expected"):
        w8a16_linear(torch.randn(2, 48), qweight, scales)
    with pytest.raises(ValueError, match="GROUP a multiple of 32"):
        w8a16_linear(torch.randn(2, 64), qweight, scales.repeat(1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 256])
def test_llama8b_shapes_gpu(m: int) -> None:
    qweight, scales = _weights(4096, 4096, 32)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    args = (x, qweight.cuda(), scales.cuda())
    torch.testing.assert_close(w8a16_linear(*args).float(), w8a16_linear_ref(*args).float(),
                               rtol=2e-2, atol=2e-1)  # fmt: skip
