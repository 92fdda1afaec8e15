"""Compile the weight-only GEMM kernels for an H100/H200 (sm_90) without a GPU and count the
global loads in their PTX: ``python -m tests.kernels.ptx_loads`` prints one JSON object,
kernel variant -> {load instruction: count}.

Run in its own process with ``TRITON_INTERPRET`` unset (the suite sets it without a GPU, and
interpreted kernels cannot be compiled). Session 14 found the W4A16 and W8A16 kernels loading
their codes one byte at a time (``ld.global.b8``), because the compiler could not prove a K
run's start aligned; test_wide_loads.py keeps it from coming back.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tokenmill.kernels.w4a16_gemm import _w4a16_kernel
from tokenmill.kernels.w8a16_gemm import _w8a16_kernel

# Global loads, synchronous (ld.global...) or pipelined into shared memory (cp.async...).
_LOAD = re.compile(r"(?:ld\.global|cp\.async\.c[ag]\.shared\.global)[.\w]*")
_ARGS = ("M", "N", "K", "SPLIT_K", "stride_xm", "stride_xk")
_TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "PARTIAL": False, "DOT_FP32": False}


def _compile(fn, pointers: dict[str, str], strides: list[str], constexprs: dict) -> str:
    """PTX of ``fn`` for sm_90 with 16-byte aligned pointers, N, K and strides (what Triton
    specializes a launch on for the engine's weights) and x's inner stride 1."""
    names = [*pointers, *_ARGS[:5], *strides]
    signature = {**pointers, **{n: "i32" for n in names[len(pointers) :]}}
    signature.update({"stride_xk": "constexpr", **{c: "constexpr" for c in constexprs}})
    aligned = [*pointers, "N", "K", "stride_xm", *[s for s in strides if s != "stride_yn"]]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, signature, {"stride_xk": 1, **constexprs}, attrs)
    kernel = triton.compile(src, GPUTarget("cuda", 90, 32), {"num_warps": 4, "num_stages": 3})
    return kernel.asm["ptx"]


def global_loads(ptx: str) -> dict[str, int]:
    """Load instruction -> how many the PTX holds (``cp.async.cg`` copies 16 bytes)."""
    return dict(Counter(_LOAD.findall(ptx)))


def main() -> None:
    """The default small-M tiles' variants (tensor-core dots): what decode runs."""
    w4 = _compile(
        _w4a16_kernel,
        {"x_ptr": "*bf16", "qw_ptr": "*u8", "s_ptr": "*fp16", "m_ptr": "*fp16", "y_ptr": "*bf16"},
        ["stride_qn", "stride_sn", "stride_mn", "stride_ym", "stride_yn"],
        {"GROUP": 32, **_TILE, "BLOCK_K": 256, "MMA": True},
    )  # fmt: skip
    w8 = _compile(
        _w8a16_kernel,
        {"x_ptr": "*bf16", "qw_ptr": "*i8", "s_ptr": "*fp16", "y_ptr": "*bf16"},
        ["stride_qn", "stride_sn", "stride_ym", "stride_yn"],
        {"GROUP": 32, **_TILE, "BLOCK_K": 256, "MMA": True},
    )
    print(json.dumps({"w4a16": global_loads(w4), "w8a16": global_loads(w8)}))


if __name__ == "__main__":
    main()
