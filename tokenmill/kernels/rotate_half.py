"""``apply_rope``: the rotary embedding in pure PyTorch, HF's rotate-half layout.

The engine's torch path and the reference of the Triton RoPE kernel (``rope.py``) both use
it; it lives here, importing nothing of the engine, so the kernels never import the engine.
"""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, d] in HF's rotate-half layout: the halves (x1, x2) become
    (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
