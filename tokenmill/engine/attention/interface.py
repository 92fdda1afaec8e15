"""AttentionBackend: what the engine may ask of an attention implementation.

A backend turns the step's CommonAttentionMetadata into whatever it needs (``build``, once
per step) and then, per layer, stores the new K/V into the paged cache and attends
(``forward``). The KV cache of one layer is one tensor:

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (K at [0], V at [1])

Implementations: ``torch_backend`` (the reference, any device) and ``triton_backend``
(paged FlashAttention kernels, CUDA); ``backend.py`` holds the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from tokenmill.engine.attention.metadata import CommonAttentionMetadata


class AttentionBackend(ABC):
    """One way to run paged attention. What the rest of the engine may ask of a backend is
    here, as class attributes and methods, never by its name:

    ``fused_layers``   the model's norm, RoPE and SiLU run as fused Triton kernels beside it
    ``cuda_graphs``    decode steps may be captured and replayed as CUDA graphs
    ``max_decode_query_len``  the most query tokens (1 + drafts) of a decode row that a
                       captured decode step may hold
    """

    name: ClassVar[str]
    fused_layers: ClassVar[bool] = False
    cuda_graphs: ClassVar[bool] = False
    max_decode_query_len: ClassVar[int] = 1

    def set_max_model_len(self, max_model_len: int) -> None:  # noqa: B027 (optional hook)
        """Told once, after the engine sized its KV cache; a no-op unless a backend needs it."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Per-step metadata for ``forward``; called once per step, outside the layers."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, d]
        k: torch.Tensor,  # [T, Hkv, d]
        v: torch.Tensor,  # [T, Hkv, d]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, d]
        meta: Any,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, d]
        """Store the step's k/v in ``kv_cache`` and attend; returns the attention output."""
