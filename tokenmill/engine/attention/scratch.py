"""Named scratch buffers that every layer of a step reuses (the CPU attention temporaries).

glibc's malloc gives large freed blocks back to the OS, so a fresh multi-MiB temporary per
layer can cost a page fault per 4 KiB on first touch: at 1,024 decode rows of a 2-KV-head,
d = 16 model, gathering a layer's K (4 MiB) into a new tensor took ~0.85 ms, into a kept one
~0.07-0.14 ms. A buffer is kept while it is at most ``max_bytes``; bigger requests get a
fresh tensor (their own compute then dwarfs the faults), so no more than that a name stays
allocated.

Reuse is safe because layers run one after another and nothing returned outlives the call
that asked for the buffer; on CPU every op has finished when it returns.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ScratchBuffers"]

_DEFAULT_MAX_BYTES = 256 << 20


class ScratchBuffers:
    """``get(name, shape, like)``: an uninitialized tensor of ``shape`` with ``like``'s dtype
    and device, backed by the buffer kept under ``name`` (grown as needed)."""

    def __init__(self, max_bytes: int = _DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        if numel * like.element_size() > self.max_bytes:
            return like.new_empty(shape)
        buf = self._buffers.get(name)
        if (
            buf is None
            or buf.numel() < numel
            or buf.dtype != like.dtype
            or buf.device != like.device
        ):
            # A quarter of headroom: rows grow a token a step, so the size creeps up.
            grown = min(numel + numel // 4, self.max_bytes // like.element_size())
            buf = like.new_empty(grown)
            self._buffers[name] = buf
        return buf[:numel].view(shape)
