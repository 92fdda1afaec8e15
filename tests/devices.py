"""``DEVICES``: parametrize a test over the CPU and, marked ``gpu`` and skipped without one,
CUDA."""

from __future__ import annotations

import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


def gpu_also(value: object) -> object:
    """A parameter value run natively on the GPU but skipped in the Triton interpreter, where
    another value of the same test already covers the kernel's logic at many times the cost
    (the interpreter emulates 16-bit floats element by element)."""
    return pytest.param(
        value,
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="in the Triton interpreter the float32 case covers it; runs on the GPU",
        ),
    )
