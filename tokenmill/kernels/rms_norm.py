"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

    without residual:  y = w * (x * rsqrt(mean(x^2) + eps))
    with residual:     s = x + residual;  y = w * (s * rsqrt(mean(s^2) + eps));  residual <- s

Numerics mirror the engine's ``RMSNorm`` (models/layers.py): s is rounded to x's dtype (as
``x + residual`` is in torch), the statistics and the normalisation run in float32, the
normalised row is rounded to x's dtype, then multiplied by the weight and rounded again.

Shapes:
    x:        [T, H]  rows may be strided, the last dim must be contiguous
              or [T, N, H]: N heads a token, each normalised on its own (Qwen3's q/k norm,
              read straight out of the fused qkv projection: strided tokens and heads)
    residual: [T, H]  same dtype; overwritten with s (2-D x only)
    weight:   [H]     same dtype
    out:      x's shape; new (or caller's ``out``, which may be x itself)

Row r of the T * N rows is token r // N, head r % N:
    x_ptr + (r // N) * stride_xt + (r % N) * stride_xh + col

Kernel: each program normalises ROWS rows held whole in one [ROWS, BLOCK_H] tile,
BLOCK_H = next_power_of_2(H); small H packs several rows per program so every program moves
about 4096 elements.

``rms_norm_fp8`` (2-D x) runs the same kernel and, with the row still in registers, also
quantizes y per row for an FP8 linear layer (its reference: ``quantize_rows`` of y):

    y      [T, H]  x's dtype, rounded as above; written only into a caller's ``out``
    scale  [T, 1]  fp32      scale[t] = max(max_h |y[t, h]| / 448, 1e-12)
    q      [T, H]  e4m3fn    q[t, h]  = e4m3(clamp(y[t, h] / scale[t], -448, 448))

q and scale are computed from y *after* its rounding to x's dtype, widened back to fp32
(exactly), which is what ``quantize_rows(y)`` reads; with fp8_tiles.py's IEEE divisions and
round-to-nearest-even cast, they equal ``quantize_rows(y)`` bit for bit in the interpreter.
Compiled for CUDA, the two variants may sum a row's squares in different orders (the
compiler also recomputes the row for the quantizing half), so y can be an ulp off the plain
kernel's and q one e4m3 step off at a value next to a rounding tie (H200: <= 6 of 16M
values); tests/kernels/fp8_row_checks.py bounds both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8_rows import FP8, quantize_rows
from tokenmill.kernels.fp8_tiles import round_in_fp32, row_scale, to_e4m3

__all__ = ["rms_norm", "rms_norm_fp8", "rms_norm_fp8_ref", "rms_norm_ref"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_BLOCK_H = 65536  # a whole row lives in registers; wider rows would spill
_ELEMENTS_PER_PROGRAM = 4096


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    # pointers
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,  # y; only its dtype is used when WRITE_OUT is False
    q_ptr,  # FP8_OUT: [T, H] e4m3
    scale_ptr,  # FP8_OUT: [T] fp32
    # sizes
    num_rows,  # T * N
    num_heads,  # N (1 for 2-D x)
    hidden,
    eps,
    # strides (tokens, heads; the last dim is contiguous)
    stride_xt,
    stride_xh,
    stride_rt,
    stride_ot,
    stride_oh,
    stride_qt,
    # meta-parameters
    HAS_RESIDUAL: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    FP8_OUT: tl.constexpr,  # 2-D only: rows are tokens
    ROUND_IN_FP32: tl.constexpr,  # the interpreter's e4m3 cast: see fp8_tiles.py
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK_H)[None, :]  # [1, BLOCK_H]
    mask = (rows < num_rows) & (cols < hidden)
    tok = rows // num_heads
    head = rows % num_heads

    x = tl.load(x_ptr + tok * stride_xt + head * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # 2-D only: tok == rows
        r_ptrs = residual_ptr + tok * stride_rt + cols
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like torch's add
        tl.store(r_ptrs, x, mask=mask)

    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=1) / hidden  # [ROWS]; masked columns add 0
    rstd = tl.rsqrt(mean_sq + eps)
    normed = (xf * rstd[:, None]).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    if WRITE_OUT:
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + cols, y, mask=mask)
    if FP8_OUT:
        yf = y.to(tl.float32)  # the rounded y, exactly: what quantize_rows(y) reads
        scale = row_scale(tl.max(tl.abs(yf), axis=1))[:, None]  # [ROWS, 1]; masked cols 0
        tl.store(scale_ptr + rows, scale, mask=rows < num_rows)
        q = to_e4m3(yf, scale, ROUND_IN_FP32)
        tl.store(q_ptr + rows * stride_qt + cols, q, mask=mask)


def _launch_config(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_H, ROWS, num_warps) for rows of ``hidden`` elements."""
    block_h = triton.next_power_of_2(hidden)
    rows = max(1, min(16, _ELEMENTS_PER_PROGRAM // block_h))
    # ~16 elements a thread: 8 warps for H=4096, 16 for H >= 8192.
    num_warps = max(1, min(16, rows * block_h // 512))
    return block_h, rows, num_warps


def _check_like(name: str, t: torch.Tensor, shape: tuple[int, ...], x: torch.Tensor) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} like x; got {tuple(t.shape)}")
    if t.dtype != x.dtype:
        raise ValueError(f"{name} dtype {t.dtype} differs from x's {x.dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if t.dim() >= 2 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim; strides {t.stride()}")


def _token_head_strides(t: torch.Tensor) -> tuple[int, int]:
    """(token stride, head stride) of a [T, H] or [T, N, H] tensor (head stride 0 in 2-D)."""
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)


def _check_inputs(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
) -> tuple[int, int, int]:
    """(T, N, H) of x after checking x, weight and residual; ValueError names the mismatch."""
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [T, H] or [T, N, H]; got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype {x.dtype} unsupported; expected one of {_DTYPES}")
    t, h = x.shape[0], x.shape[-1]
    n = x.shape[1] if x.dim() == 3 else 1
    _check_like("x", x, tuple(x.shape), x)
    _check_like("weight", weight, (h,), x)
    if weight.stride(0) != 1 and h > 1:
        raise ValueError(f"weight must be contiguous; stride {weight.stride()}")
    if residual is not None:
        if x.dim() == 3:
            raise ValueError("residual needs a 2-D x [T, H]; per-head norms take none")
        _check_like("residual", residual, (t, h), x)
    if triton.next_power_of_2(h) > _MAX_BLOCK_H:
        raise ValueError(f"hidden size {h} too large for one tile (max {_MAX_BLOCK_H})")
    return t, n, h


def _checked_out(
    out: torch.Tensor | None, x: torch.Tensor, residual: torch.Tensor | None
) -> torch.Tensor:
    """The caller's ``out`` after checks, or a new tensor like x."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _check_like("out", out, tuple(x.shape), x)
    if residual is not None and out.data_ptr() == residual.data_ptr():
        raise ValueError("out must not be residual: both results would share one buffer")
    return out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    out: torch.Tensor | None,
    fp8: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Run the kernel over x's rows (checked by the caller; at least one), writing ``out``
    when given and the (q, scale) pair ``fp8`` when given."""
    t, h = x.shape[0], x.shape[-1]
    n = x.shape[1] if x.dim() == 3 else 1
    block_h, rows, num_warps = _launch_config(h)
    res = residual if residual is not None else x  # never touched when HAS_RESIDUAL is False
    y = out if out is not None else x  # only y's dtype is read when WRITE_OUT is False
    q, scale = fp8 if fp8 is not None else (x, x)  # never touched when FP8_OUT is False
    _rms_norm_kernel[(triton.cdiv(t * n, rows),)](
        x,
        res,
        weight,
        y,
        q,
        scale,
        t * n,
        n,
        h,
        eps,
        *_token_head_strides(x),
        res.stride(0),
        *_token_head_strides(y),
        q.stride(0),
        HAS_RESIDUAL=residual is not None,
        WRITE_OUT=out is not None,
        FP8_OUT=fp8 is not None,
        ROUND_IN_FP32=round_in_fp32(),
        ROWS=rows,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )


def rms_norm(
    x: torch.Tensor,  # [T, H] or [T, N, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H], overwritten with x + residual
    out: torch.Tensor | None = None,  # x's shape; may be x
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x (or of x + residual) scaled by ``weight``, over x's last dim.

    Returns ``(y, None)`` without a residual and ``(y, residual)`` with one, where y is
    ``out`` if given (else a new tensor) and ``residual`` now holds s = x + residual.
    Buffers written: ``residual`` (in place, when given) and ``out`` (when given; it may be
    ``x`` itself, normalising x in place). ``x`` and ``weight`` are only read otherwise.
    Raises ValueError on shape, dtype, device or stride mismatches.
    """
    t, n, _ = _check_inputs(x, weight, residual)
    out = _checked_out(out, x, residual)
    if t and n:
        _launch(x, weight, eps, residual, out, None)
    return out, residual


def rms_norm_fp8(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H], overwritten with x + residual
    *,
    out: torch.Tensor | None = None,  # [T, H] in x's dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`rms_norm`'s y quantized per row to e4m3 for an FP8 linear layer, in one pass.

    Returns ``(q, scale, residual)``: q [T, H] float8_e4m3fn and scale [T, 1] float32 (new,
    contiguous), ``quantize_rows(y)`` (up to the compiled sum's order, above), and
    ``residual`` as :func:`rms_norm` returns it (now s = x + residual; None without one).
    y itself is written only into ``out``, when given (tests, benchmarks; it may be x, not
    residual). Raises ValueError on shape,
    dtype, device or stride mismatches, and for a 3-D x (per-head norms feed no FP8 layer).
    """
    if x.dim() != 2:
        raise ValueError(f"rms_norm_fp8: x must be [T, H]; got shape {tuple(x.shape)}")
    t, _, h = _check_inputs(x, weight, residual)
    if out is not None:
        out = _checked_out(out, x, residual)
    q = torch.empty(t, h, dtype=FP8, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t:
        _launch(x, weight, eps, residual, out, (q, scale))
    return q, scale, residual


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The engine's RMSNorm in torch; returns (y, s) like :func:`rms_norm` but mutates
    nothing (s = x + residual is a new tensor, None without a residual)."""
    s = None
    if residual is not None:
        x = s = x + residual
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype), s


def rms_norm_fp8_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The torch path of :func:`rms_norm_fp8`: (q, scale, s) = quantize_rows of
    :func:`rms_norm_ref`'s y, and its s; mutates nothing."""
    y, s = rms_norm_ref(x, weight, eps, residual)
    q, scale = quantize_rows(y)
    return q, scale, s
