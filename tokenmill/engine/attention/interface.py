"""AttentionBackend: what the engine may ask of an attention implementation.

A backend turns the step's CommonAttentionMetadata into whatever it needs (``build``, once
per step) and then, per layer, stores the new K/V into the paged cache and attends
(``forward``). The KV cache of one layer is one tensor whose layout the backend owns
(``kv_cache_shape``); the default, which both backends here use:

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (K at [0], V at [1])

A backend with ``cuda_graphs`` also says what a captured decode step bakes in
(``capture_metadata``).

Implementations: ``torch_backend`` (the reference, any device) and ``triton_backend``
(paged FlashAttention kernels, CUDA); ``backend.py`` holds the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import torch

from tokenmill.engine.attention.metadata import CommonAttentionMetadata


class AttentionBackend(ABC):
    """One way to run paged attention. What the rest of the engine may ask of a backend is
    here, as class attributes and methods, never by its name:

    ``fused_layers``   the model's norm, RoPE and SiLU run as fused Triton kernels beside it
    ``cuda_graphs``    decode steps may be captured and replayed as CUDA graphs
    ``max_decode_query_len``  the most query tokens (1 + drafts) of a decode row that its
                       decode path takes (and a captured decode step may hold)
    """

    name: ClassVar[str]
    fused_layers: ClassVar[bool] = False
    cuda_graphs: ClassVar[bool] = False
    max_decode_query_len: ClassVar[int] = 1

    def workspace_bytes(
        self, max_model_len: int, max_decode_tokens: int, num_q_heads: int, head_dim: int
    ) -> int:
        """Device bytes of the scratch that ``forward`` allocates beside the KV cache at the
        engine's limits: requests of up to ``max_model_len`` keys, up to
        ``max_decode_tokens`` query tokens of decode rows a step, ``num_q_heads`` query heads
        (the rank's) of ``head_dim``. The engine asks before it sizes the KV cache, and a
        budget taken from free memory (a fraction) leaves these bytes out; 0 (the default)
        for a backend whose scratch is too small to count."""
        return 0

    def set_engine_limits(  # noqa: B027
        self, max_model_len: int, max_num_seqs: int, device: torch.device
    ) -> None:
        """Told once, after the engine sized its KV cache: the longest request, the most
        requests a step and the device the engine runs on. An optional hook: a no-op unless
        a backend needs them."""

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's KV cache, the ``kv_cache`` that ``forward`` gets; the runner
        allocates it zeroed, in the model's dtype, and sizes num_blocks from its bytes."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def capture_metadata(self, common: CommonAttentionMetadata, max_model_len: int) -> Any:
        """Per-step metadata for a decode step captured in a CUDA graph. ``common`` holds the
        static buffers the graph reads; between replays their lengths change, up to
        ``max_model_len``, so whatever the result fixes on the host (grid sizes, split
        counts) must serve any of them. Default: ``build`` with every sequence that long."""
        return self.build(replace(common, seq_lens_host=np.full(common.num_reqs, max_model_len)))

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
        out: torch.Tensor | None = None,  # [T, Hq, d]
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, Hq, d]
        """Store the step's k/v in ``kv_cache`` (unless ``kv_stored``: the rope kernel did,
        at ``rope_kv_slots(meta)``) and attend; returns the attention output, written into
        ``out`` when given (the piecewise graphs' static buffer) else into a new tensor."""

    def rope_kv_slots(self, meta: Any) -> torch.Tensor | None:
        """The slot mapping [T] int64 at which the fused rope kernel may store this step's
        K/V, so that ``forward`` (told ``kv_stored``) launches no store of its own; None (the
        default) where the backend stores them itself."""
        return None
