"""rms_norm (Triton) against rms_norm_ref, with and without the fused residual add; and
rms_norm_fp8, the same norm written as FP8 rows, against quantize_rows of it."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.fp8_row_checks import assert_fp8_rows_near, assert_fp8_rows_of
from tokenmill.engine.models.layers import RMSNorm
from tokenmill.kernels.fp8_rows import MIN_SCALE
from tokenmill.kernels.rms_norm import rms_norm, rms_norm_fp8, rms_norm_fp8_ref, rms_norm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
# Triton's interpreter truncates fp32 -> bf16 where the GPU (and torch) round to nearest:
# bf16 results there can be one ulp (2^-7 relative at most) further off.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Both sides compute rsqrt(mean(x^2)) in fp32 and differ only in summation order (a few fp32
# ulps in rstd); that can flip one rounding of the normalised value to the dtype and then
# of the product with the weight: at most ~2 ulps of the dtype (bf16 ulp 2^-8 relative,
# fp16 2^-11; bf16 also covers the interpreter's truncation). fp32 differs by a few ulps.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def _sum_tol(dtype: torch.dtype) -> dict[str, float]:
    """s = x + residual: exact, as both add in fp32 and round once to the dtype; one bf16
    ulp under the interpreter."""
    if INTERPRETED and dtype == torch.bfloat16:
        return dict(rtol=8e-3, atol=0.0)
    return dict(rtol=0.0, atol=0.0)


def _inputs(t: int, h: int, dtype: torch.dtype, pad: int = 0):
    gen = torch.Generator().manual_seed(t * 31 + h)
    wide = torch.randn(t, h + pad, generator=gen).to(DEVICE, dtype)
    x = wide[:, :h]  # [T, H], row stride H + pad when pad > 0
    residual = (2 * torch.randn(t, h, generator=gen)).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(h, generator=gen)).to(DEVICE, dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("t", "h", "pad"), [(5, 576, 0), (3, 64, 0), (2, 1000, 24)])
def test_rms_norm_matches_ref(t, h, pad, with_residual, dtype) -> None:
    x, residual, weight = _inputs(t, h, dtype, pad)
    x_before = x.clone()
    res_ref_in = residual.clone() if with_residual else None
    y, s = rms_norm(x, weight, EPS, residual if with_residual else None)
    y_ref, s_ref = rms_norm_ref(x, weight, EPS, res_ref_in)
    assert y.dtype == dtype and y.shape == (t, h)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)  # x is only read
    if with_residual:
        assert s is residual  # written in place
        torch.testing.assert_close(s, s_ref, **_sum_tol(dtype))
    else:
        assert s is None


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(5, 4, 2, 32), (3, 3, 1, 64)])
def test_per_head_norm_reads_the_fused_qkv_view(t, hq, hkv, d, dtype) -> None:
    """Qwen3's q/k norm: [T, N, d] views into the qkv projection (token stride (hq + 2 hkv)
    d, head stride d), each head normalised on its own; in place and into a new tensor."""
    gen = torch.Generator().manual_seed(t + d)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(d, generator=gen)).to(DEVICE, dtype)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
    q_ref, _ = rms_norm_ref(q, weight, EPS)
    k_ref, _ = rms_norm_ref(k, weight, EPS)
    before = qkv.clone()
    y, s = rms_norm(q, weight, EPS)
    assert s is None and y.shape == (t, hq, d)
    torch.testing.assert_close(y, q_ref, **TOL[dtype])
    torch.testing.assert_close(qkv, before, atol=0, rtol=0)  # read only
    rms_norm(k, weight, EPS, out=k)  # in place, inside qkv
    torch.testing.assert_close(qkv[:, hq : hq + hkv], k_ref, **TOL[dtype])
    torch.testing.assert_close(qkv[:, :hq], before[:, :hq], atol=0, rtol=0)
    torch.testing.assert_close(qkv[:, hq + hkv :], before[:, hq + hkv :], atol=0, rtol=0)
    with pytest.raises(ValueError, match="per-head norms take none"):
        rms_norm(q, weight, EPS, residual=torch.zeros_like(q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_in_place_out(dtype) -> None:
    x, residual, weight = _inputs(4, 576, dtype)
    y_ref, _ = rms_norm_ref(x, weight, EPS)
    y, _ = rms_norm(x, weight, EPS, out=x)  # normalise x where it lies
    assert y is x
    torch.testing.assert_close(x, y_ref, **TOL[dtype])


def test_rms_norm_ref_is_engine_rmsnorm() -> None:
    x, _, weight = _inputs(3, 64, torch.bfloat16)
    layer = RMSNorm(64, EPS).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
        expected = layer(x)
    torch.testing.assert_close(rms_norm_ref(x, weight, EPS)[0], expected, atol=0, rtol=0)


def test_rms_norm_rejects_mismatch() -> None:
    x, residual, weight = _inputs(2, 64, torch.float32)
    with pytest.raises(ValueError, match="weight dtype"):
        rms_norm(x, weight.half(), EPS)
    with pytest.raises(ValueError, match="residual must have shape"):
        rms_norm(x, weight, EPS, residual[:1])
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        rms_norm(x.t().contiguous().t(), weight, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h", [4096, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_engine_size(h, with_residual, dtype) -> None:
    x, residual, weight = _inputs(4096, h, dtype)
    res_ref_in = residual.clone() if with_residual else None
    y, s = rms_norm(x, weight, EPS, residual if with_residual else None)
    y_ref, s_ref = rms_norm_ref(x, weight, EPS, res_ref_in)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    if with_residual:
        torch.testing.assert_close(s, s_ref, **_sum_tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_per_head_norm_engine_size(dtype) -> None:
    """Qwen3-0.6B's q norm at a full step: 8,192 tokens x 16 heads x 128."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(8192, 32, 128, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(128, generator=gen)).to(DEVICE, dtype)
    y, _ = rms_norm(qkv[:, :16], weight, EPS)
    y_ref, _ = rms_norm_ref(qkv[:, :16], weight, EPS)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


# rms_norm_fp8: the norm quantized per row to e4m3 in the same pass. Exact, no tolerance:
# its y is rms_norm's y (the same code and launch), and q / scale are quantize_rows of that
# rounded y (IEEE divisions, round to nearest even), in the interpreter too.


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("t", "h", "pad"), [(5, 576, 0), (17, 256, 0), (2, 1000, 24)])
def test_rms_norm_fp8_is_quantize_rows_of_the_norm(t, h, pad, with_residual, dtype) -> None:
    x, residual, weight = _inputs(t, h, dtype, pad)
    if not with_residual:
        x[0] = 0  # an all-zero row: the 1e-12 scale floor
    res_in = residual if with_residual else None
    res_plain, res_ref = (residual.clone() if with_residual else None for _ in range(2))
    y = torch.empty(t, h, dtype=dtype, device=DEVICE)
    q, scale, s = rms_norm_fp8(x, weight, EPS, res_in, out=y)
    y_plain, s_plain = rms_norm(x, weight, EPS, res_plain)
    assert torch.equal(y, y_plain)  # (17, 256): 16 rows a program, the second one ragged
    assert_fp8_rows_of(q, scale, y)
    if with_residual:
        assert s is residual and torch.equal(s, s_plain)  # the sum, written in place
    else:
        assert s is None and scale[0].item() == pytest.approx(MIN_SCALE)
    # The torch path's y may be an ulp off (see TOL), so a value one e4m3 step (1/8) away.
    q_ref, scale_ref, _ = rms_norm_fp8_ref(x, weight, EPS, res_ref)
    torch.testing.assert_close(
        q.float() * scale, q_ref.float() * scale_ref, rtol=0.13, atol=scale.max().item() / 512
    )


def test_rms_norm_fp8_without_out_and_without_tokens() -> None:
    x, residual, weight = _inputs(3, 64, torch.bfloat16)
    q, scale, s = rms_norm_fp8(x, weight, EPS)
    y, _ = rms_norm(x, weight, EPS)
    assert s is None
    assert_fp8_rows_of(q, scale, y)
    q, scale, s = rms_norm_fp8(x[:0], weight, EPS, residual[:0])
    assert q.shape == (0, 64) and scale.shape == (0, 1) and s.shape == (0, 64)


def test_rms_norm_fp8_rejects_what_it_cannot_quantize() -> None:
    x, residual, weight = _inputs(2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be \[T, H\]"):
        rms_norm_fp8(x.view(2, 4, 16), weight[:16], EPS)  # per-head norms feed no FP8 layer
    with pytest.raises(ValueError, match="out must not be residual"):
        rms_norm_fp8(x, weight, EPS, residual, out=residual)
    with pytest.raises(ValueError, match="weight dtype"):
        rms_norm_fp8(x, weight.float(), EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("t", [1, 333, 2048, 4096])
def test_rms_norm_fp8_llama8b_width_gpu(t, with_residual, dtype) -> None:
    """Llama-3-8B's hidden 4096: quantize_rows of rms_norm's y, up to the compiled sum's
    order (measured on the H200: y an ulp or two off in <= 0.4% of values, q one e4m3 step
    off in <= 6 of 16M values, each next to a rounding tie)."""
    x, residual, weight = _inputs(t, 4096, dtype)
    res_plain = residual.clone() if with_residual else None
    y = torch.empty(t, 4096, dtype=dtype, device=DEVICE)
    q, scale, s = rms_norm_fp8(x, weight, EPS, residual if with_residual else None, out=y)
    y_plain, s_plain = rms_norm(x, weight, EPS, res_plain)
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)  # relative, at worst
    torch.testing.assert_close(y, y_plain, rtol=2 * ulp, atol=0)  # an ulp or two
    assert (y != y_plain).float().mean().item() <= 0.01
    assert_fp8_rows_near(q, scale, y)
    assert_fp8_rows_near(q, scale, y_plain)
    assert (s is None) == (s_plain is None) and (s is None or torch.equal(s, s_plain))
    q_alone, scale_alone, _ = rms_norm_fp8(x, weight, EPS)  # no out: y is never written
    if not with_residual:
        assert torch.equal(q_alone.float(), q.float()) and torch.equal(scale_alone, scale)


@pytest.mark.gpu
def test_rms_norm_fp8_captures_in_a_cuda_graph_gpu() -> None:
    x, residual, weight = _inputs(64, 4096, torch.bfloat16)
    rms_norm_fp8(x, weight, EPS, residual.clone())  # compile outside the capture
    start = residual.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scale, _ = rms_norm_fp8(x, weight, EPS, residual)
    residual.copy_(start)
    x.copy_(_inputs(64, 4096, torch.bfloat16)[1])  # new values in the captured buffers
    graph.replay()
    torch.cuda.synchronize()
    y_ref, s_ref = rms_norm(x, weight, EPS, start)
    assert torch.equal(residual, s_ref)
    assert_fp8_rows_near(q, scale, y_ref)
