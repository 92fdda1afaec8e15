"""Tree masks in plain torch (no Triton): which keys each query of one request may see when
its step tokens form a tree of candidate branches (see paged_prefill_attention.py's top).
The prefill kernel's reference and the torch backend use it."""

from __future__ import annotations

import torch

__all__ = ["tree_visible"]


def tree_visible(masks: torch.Tensor, ctx: int, seq_len: int) -> torch.Tensor:
    """[q_len, seq_len] bool: which keys each of a request's queries may see by its tree mask
    (``masks`` [q_len] int64): every key before ``ctx``, and step key ``ctx + j`` where bit j
    is set (a -1 mask: all of them). Causality is applied apart."""
    rel = torch.arange(seq_len, device=masks.device) - ctx  # [S]
    bits = (masks[:, None] >> rel.clamp(0, 63)[None, :]) & 1
    far = (rel >= 64)[None, :] & (masks == -1)[:, None]
    return (rel < 0)[None, :] | (bits != 0) | far
