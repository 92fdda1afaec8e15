"""w4a16_linear (Triton) against w4a16_linear_ref, and the q4-rows packing."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.int_weight_tilings import TILINGS
from tokenmill.kernels.int_weight_tiles import IntGemmTiles
from tokenmill.kernels.w4a16_gemm import dequantize_q4, pack_q4, w4a16_linear, w4a16_linear_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Both accumulate in fp32 and round once; the kernel rounds each dequantized weight to x's
# dtype before its dot on the GPU (a 16-bit weight, as a 16-bit GEMM would hold it).
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-4),
    torch.float16: dict(rtol=4e-3, atol=4e-2),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-1),
}


def _weights(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).half()
    mins = (-8 * scales.float() + torch.randn(n, k // group, generator=g) * 0.01).half()
    return codes, pack_q4(codes), scales, mins


def test_packing_round_trips_and_dequantizes() -> None:
    codes, qweight, scales, mins = _weights(6, 64, 32)
    assert qweight.shape == (6, 32) and qweight.dtype == torch.uint8
    # chunk 0 of row 0: byte i = code i (low) | code i + 16 (high)
    assert int(qweight[0, 3]) == int(codes[0, 3]) | (int(codes[0, 19]) << 4)
    w = dequantize_q4(qweight, scales, mins)
    want = codes.float() * scales.float().repeat_interleave(32, 1) + mins.float().repeat_interleave(
        32, 1
    )
    assert torch.equal(w, want)


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "dtype"),
    [
        (1, 64, 64, 32, torch.float32),  # one decode row
        (5, 48, 128, 32, torch.float16),  # N not a multiple of the tile
        (17, 64, 128, 64, torch.bfloat16),  # two M tiles, groups of 64
        (3, 32, 256, 128, torch.float32),  # GPTQ/AWQ-sized groups
    ],
)
def test_matches_reference(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> None:
    _, qweight, scales, mins = _weights(n, k, group, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = [t.to(DEVICE) for t in (x, qweight, scales, mins)]
    y = w4a16_linear(*args)
    ref = w4a16_linear_ref(*args)
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize(("tiles", "group"), TILINGS)
def test_tilings_match_reference(tiles: IntGemmTiles, group: int) -> None:
    """Every tiling computes the same product; fp32 inputs, so within fp32 rounding of the
    reference."""
    m, n, k = 3, 40, 512
    _, qweight, scales, mins = _weights(n, k, group, seed=group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    args = [t.to(DEVICE) for t in (x, qweight, scales, mins)]
    y = w4a16_linear(*args, tiles=tiles)
    torch.testing.assert_close(y, w4a16_linear_ref(*args), **TOL[torch.float32])


def test_rejects_bad_shapes() -> None:
    _, qweight, scales, mins = _weights(8, 64, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        w4a16_linear(torch.randn(2, 48), qweight[:, :24], scales, mins)
    with pytest.raises(ValueError, match="scales and mins"):
        w4a16_linear(torch.randn(2, 64), qweight, scales, mins[:, :1])
    with pytest.raises(ValueError, match="uint8"):
        w4a16_linear(torch.randn(2, 64), qweight.int(), scales, mins)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 256])
def test_llama8b_shapes_gpu(m: int) -> None:
    _, qweight, scales, mins = _weights(4096, 4096, 32)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    args = (x, qweight.cuda(), scales.cuda(), mins.cuda())
    torch.testing.assert_close(w4a16_linear(*args).float(), w4a16_linear_ref(*args).float(),
                               rtol=2e-2, atol=2e-1)  # fmt: skip


@pytest.mark.gpu
def test_split_k_gives_the_same_bits_every_call_gpu() -> None:
    """Split-K partial sums are added in a fixed order (no atomics): CUDA graphs and eager
    steps, and reruns of a job, see the same bits."""
    _, qweight, scales, mins = _weights(4096, 4096, 32)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    args = (x, qweight.cuda(), scales.cuda(), mins.cuda())
    tiles = IntGemmTiles(16, 64, 256, split_k=8)
    first = w4a16_linear(*args, tiles=tiles)
    assert all(torch.equal(w4a16_linear(*args, tiles=tiles), first) for _ in range(20))
