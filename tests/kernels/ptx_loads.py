"""Compile the weight GEMM kernels (W4A16, W8A16, FP8) for an H100/H200 (sm_90) without a GPU
and count the global loads in their PTX: ``python -m tests.kernels.ptx_loads`` prints one
JSON object, kernel -> {load instruction: count}.

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

from tokenmill.kernels.fp8_gemm import _fp8_gemm_kernel
from tokenmill.kernels.w4a16_gemm import _w4a16_kernel
from tokenmill.kernels.w8a16_gemm import _w8a16_kernel

# Global loads, synchronous (ld.global...) or pipelined into shared memory (cp.async...).
_LOAD = re.compile(r"(?:ld\.global|cp\.async\.c[ag]\.shared\.global)[.\w]*")
_TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "PARTIAL": False, "DOT_FP32": False}
_UNALIGNED = {"M", "SPLIT_K", "stride_yn"}  # runtime values Triton does not specialize here


def _compile(fn, pointers: dict[str, str], constexprs: dict) -> str:
    """PTX of ``fn`` for sm_90: ``pointers`` typed as given, every other integer argument an
    i32 that is a multiple of 16 (as Triton specializes a launch on the engine's weights:
    aligned pointers, N, K and row strides) but M, SPLIT_K and the output's column stride,
    and ``constexprs`` (an inner stride of 1 among them, as Triton specializes it)."""
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "i32")
            if name not in _UNALIGNED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs, attrs)
    kernel = triton.compile(src, GPUTarget("cuda", 90, 32), {"num_warps": 4, "num_stages": 3})
    return kernel.asm["ptx"]


def global_loads(ptx: str) -> dict[str, int]:
    """Load instruction -> how many the PTX holds (``cp.async.cg`` copies 16 bytes)."""
    return dict(Counter(_LOAD.findall(ptx)))


def main() -> None:
    """The default small-M tiles' variants (tensor-core dots): what decode runs; the FP8
    GEMM at its default tiles."""
    w4 = _compile(
        _w4a16_kernel,
        {"x_ptr": "*bf16", "qw_ptr": "*u8", "s_ptr": "*fp16", "m_ptr": "*fp16", "y_ptr": "*bf16"},
        {"stride_xk": 1, "GROUP": 32, **_TILE, "BLOCK_K": 512, "MMA": True},
    )  # fmt: skip
    w8 = _compile(
        _w8a16_kernel,
        {"x_ptr": "*bf16", "qw_ptr": "*i8", "s_ptr": "*fp16", "y_ptr": "*bf16"},
        {"stride_xk": 1, "GROUP": 32, **_TILE, "BLOCK_K": 256, "MMA": True},
    )
    fp8 = _compile(
        _fp8_gemm_kernel,
        {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
         "y_ptr": "*bf16"},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 256, "PARTIAL": False, "DOT_FP32": False},
    )  # fmt: skip
    loads = {"w4a16": global_loads(w4), "w8a16": global_loads(w8), "fp8": global_loads(fp8)}
    print(json.dumps(loads))


if __name__ == "__main__":
    main()
