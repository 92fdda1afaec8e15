"""silu_and_mul (Triton) against silu_and_mul_ref over shapes, dtypes and strided rows."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.models.layers import silu_and_mul as engine_silu_and_mul
from tokenmill.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

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
