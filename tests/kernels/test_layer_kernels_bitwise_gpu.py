"""On the GPU the fused layer kernels give the engine's torch path's exact bits (bf16, fp16).

Any last-bit difference between the backends grows, layer by layer, into a different greedy
token (bench/layer_divergence.py shows where). The per-kernel tests allow an ulp, because the
interpreter rounds differently and the compiler may contract a multiply and an add; these
full-size GPU cases allow none. They caught RoPE's products being fused into one FMA (one
rounding where torch rounds twice), which differed in 24% of elements.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.models.layers import RMSNorm, silu_and_mul
from tokenmill.engine.models.rope import apply_rope
from tokenmill.kernels.rope import rope_

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]
RMS_NORM_MAX_SHARE = 1e-4


def _differ(a: torch.Tensor, b: torch.Tensor) -> str:
    n = (a != b).sum().item()
    return f"{n} of {a.numel()} elements differ (max {(a.float() - b.float()).abs().max():.2e})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(32, 8, 128), (9, 3, 64)])
def test_rope_bitwise(hq: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    t, max_pos = 4096, 8192
    qkv = (3 * torch.randn(t, hq + 2 * hkv, d, generator=gen, device="cuda")).to(dtype)
    positions = torch.randint(0, max_pos, (t,), generator=gen, device="cuda")
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda").float() / d)
    freqs = torch.outer(torch.arange(max_pos, device="cuda").float(), inv_freq)  # [P, d/2]
    cos, sin = freqs.cos(), freqs.sin()
    # the engine's torch path: tables looked up and cast, q and k rotated in one pass
    want = apply_rope(
        qkv[:, : hq + hkv],
        cos[positions].unsqueeze(1).to(dtype),
        sin[positions].unsqueeze(1).to(dtype),
    )
    rope_(qkv[:, :hq], qkv[:, hq : hq + hkv], positions, cos, sin)
    got = qkv[:, : hq + hkv]
    assert torch.equal(got, want), _differ(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [14336, 1536])
def test_silu_and_mul_bitwise(inter: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = (3 * torch.randn(4096, 2 * inter, generator=gen, device="cuda")).to(dtype)
    got, want = silu_and_mul(x, fused=True), silu_and_mul(x, fused=False)
    assert torch.equal(got, want), _differ(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h", [4096, 576])
def test_rms_norm_with_residual_bitwise(h: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = (3 * torch.randn(4096, h, generator=gen, device="cuda")).to(dtype)
    residual = (3 * torch.randn(4096, h, generator=gen, device="cuda")).to(dtype)
    plain = RMSNorm(h, 1e-5).to("cuda", dtype)
    fused = RMSNorm(h, 1e-5, fused=True).to("cuda", dtype)
    with torch.no_grad():
        plain.weight.normal_(generator=gen)
        fused.weight.copy_(plain.weight)
    want, want_sum = plain(x, residual.clone())
    got, got_sum = fused(x, residual.clone())
    assert torch.equal(got_sum, want_sum), _differ(got_sum, want_sum)
    # The mean of squares is a sum over the row in another order than torch's reduction; a
    # last-bit difference in it can move a rounding of the normalised value.
    for got_y, want_y in ((got, want), (fused(x), plain(x))):
        share = (got_y != want_y).float().mean().item()
        print(f"rms_norm h={h} {dtype}: {_differ(got_y, want_y)}")
        assert share <= RMS_NORM_MAX_SHARE, _differ(got_y, want_y)
