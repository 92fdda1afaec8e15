"""The attention backend interface and its registry.

A backend turns the step's CommonAttentionMetadata into whatever it needs (``build``, once
per step) and then, per layer, stores the new K/V into the paged cache and attends
(``forward``). The KV cache of one layer is one tensor:

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (K at [0], V at [1])
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tokenmill.engine.attention.metadata import CommonAttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def build(self, common: CommonAttentionMetadata) -> Any:
        """Per-step metadata for ``forward``; called once per step, outside the layers."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, d]
        k: torch.Tensor,  # [T, Hkv, d]
        v: torch.Tensor,  # [T, Hkv, d]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, d]
        meta: Any,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, d]
        ...


def get_attention_backend(name: str, num_kv_heads: int) -> AttentionBackend:
    """Backend by name for a model with ``num_kv_heads``; ValueError lists the known ones."""
    if name == "torch":
        from tokenmill.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from tokenmill.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(num_kv_heads)
    raise ValueError(f"unknown attention backend {name!r}; available: torch, triton")


def default_backend_name(device: torch.device) -> str:
    """Triton kernels on CUDA, the torch reference elsewhere."""
    return "triton" if device.type == "cuda" else "torch"
