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
