"""dequantize_q8_rows (Triton) against dequantize_q8, its reference."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.q8_dequantize import dequantize_q8_rows
from tokenmill.kernels.w8a16_gemm import dequantize_q8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    scales = (torch.rand(n, k // group, generator=g) * 0.002 + 0.0001).half()
    return codes.to(DEVICE), scales.to(DEVICE)


@pytest.mark.parametrize(
    ("n", "k", "group", "block_k"),
    [
        (5, 96, 32, 256),  # fewer rows than a tile; block_k fitted down to 32 (K = 96)
        (40, 512, 32, 256),  # rows over two tiles, 8 groups a tile
        (33, 512, 128, 64),  # a tile inside one group
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_reference(n: int, k: int, group: int, block_k: int, dtype) -> None:
    qweight, scales = _weights(n, k, group, seed=n)
    got = dequantize_q8_rows(qweight, scales, dtype, block_k=block_k)
    want = dequantize_q8(qweight, scales)  # fp32: code * scale, exact in fp32
    assert got.shape == (n, k) and got.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # rounded once from the same fp32 (the interpreter's bf16 casts truncate: an ulp)
        ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
        torch.testing.assert_close(got, want.to(dtype), rtol=ulp, atol=1e-6)
        if DEVICE == "cuda":
            assert torch.equal(got, want.to(dtype))


def test_rejects_what_w8a16_would() -> None:
    qweight, scales = _weights(4, 64, 32)
    with pytest.raises(ValueError, match="int8"):
        dequantize_q8_rows(qweight.to(torch.uint8), scales)
    with pytest.raises(ValueError, match="GROUP a multiple of 32"):
        dequantize_q8_rows(qweight, scales.repeat(1, 2))
    with pytest.raises(ValueError, match="dtype"):
        dequantize_q8_rows(qweight, scales, torch.int8)
    assert dequantize_q8_rows(qweight[:0], scales[:0]).shape == (0, 64)
