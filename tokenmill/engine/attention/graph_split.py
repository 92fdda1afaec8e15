"""GraphSplit: the attention call as a seam in a CUDA graph capture.

A step the decode graphs do not cover (a prefill chunk, a mixed step, a tree of drafts)
would run the whole model eagerly: hundreds of kernel launches from Python, ~20 ms of host
time a step on a small model, however few its tokens. Everything but attention depends only
on the step's token count, so piecewise_graphs.py captures the model body between attention
calls for buckets of token counts, and runs attention itself eagerly between the pieces.

A model calls ``attend`` where it would call ``backend.forward``. When the step's metadata
is a GraphSplit (only while capturing pieces), the split takes the layer's q/k/v instead:
it ends the piece being captured, and returns a static buffer that the eager attention of a
replay fills.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from tokenmill.engine.attention.interface import AttentionBackend


class GraphSplit(ABC):
    """Stands in for the attention metadata while the pieces of a step are captured."""

    @abstractmethod
    def split(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Take one layer's q [T, Hq, d], k and v [T, Hkv, d]; return its attention output
        [T, Hq, d] as the next piece will read it."""


def attend(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: Any,
    scale: float,
    kv_stored: bool = False,
) -> torch.Tensor:
    """``backend.forward``, or the capture's split when ``meta`` is a GraphSplit (whose
    attention stores the K/V itself: ``kv_stored`` must be False there)."""
    if isinstance(meta, GraphSplit):
        if kv_stored:
            raise ValueError("attend: a graph split's attention stores K/V; none may be stored")
        return meta.split(q, k, v, kv_cache, scale)
    return backend.forward(q, k, v, kv_cache, meta, scale, kv_stored=kv_stored)
