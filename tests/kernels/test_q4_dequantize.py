"""dequantize_q4_rows (Triton) against dequantize_q4, its reference."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.q4_dequantize import dequantize_q4_rows
from tokenmill.kernels.w4a16_gemm import dequantize_q4, pack_q4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).half()
    mins = (-8 * scales.float() + torch.randn(n, k // group, generator=g) * 0.01).half()
    return pack_q4(codes).to(DEVICE), scales.to(DEVICE), mins.to(DEVICE)


@pytest.mark.parametrize(
    ("n", "k", "group", "chunks"),
    [
        (5, 64, 32, 8),  # fewer rows than a tile, fewer chunks than a program's
        (40, 256, 64, 3),  # rows over two tiles, chunks not a multiple of the program's
        (33, 512, 128, 8),  # GPTQ/AWQ-sized groups
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(n: int, k: int, group: int, chunks: int, dtype) -> None:
    qweight, scales, mins = _weights(n, k, group, seed=n)
    got = dequantize_q4_rows(qweight, scales, mins, dtype, chunks=chunks)
    want = dequantize_q4(qweight, scales, mins)  # fp32
    assert got.shape == (n, k) and got.dtype == dtype
    if dtype == torch.float32:  # the multiply-add may round once where the reference rounds
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # twice: an fp32 ulp at most
    else:  # rounded once from (nearly) the same fp32: equal, or an ulp off at a tie
        ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
        torch.testing.assert_close(got, want.to(dtype), rtol=ulp, atol=1e-6)
        if DEVICE == "cuda":  # the interpreter's casts to bf16 truncate: half the values
            assert (got != want.to(dtype)).float().mean().item() < 0.01


def test_rejects_what_w4a16_would() -> None:
    qweight, scales, mins = _weights(4, 64, 32)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_q4_rows(qweight.int(), scales, mins)
    with pytest.raises(ValueError, match="scales and mins"):
        dequantize_q4_rows(qweight, scales, mins[:, :1])
    with pytest.raises(ValueError, match="dtype"):
        dequantize_q4_rows(qweight, scales, mins, torch.int8)
    assert dequantize_q4_rows(qweight[:0], scales[:0], mins[:0]).shape == (0, 64)


@pytest.mark.gpu
def test_llama8b_down_shape_gpu() -> None:
    qweight, scales, mins = _weights(4096, 14336, 32)
    got = dequantize_q4_rows(qweight, scales, mins)
    want = dequantize_q4(qweight, scales, mins).to(torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)
