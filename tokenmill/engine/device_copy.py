"""Host <-> device copies that never block the host on the GPU.

A non-blocking copy from pageable memory may make the driver wait for the stream; staging
through pinned memory lets the host go on scheduling the next step while the GPU works.
PyTorch's pinned allocator keeps a staging buffer until the copy that reads it has run.
A step's many small inputs go together instead, through upload_ring.py.

    upload(host)        host [..] -> pinned -> device (non_blocking)
    download(t)         device [..] -> new pinned host tensor (non_blocking); read it only
                        after an event recorded behind the copy has completed
"""

from __future__ import annotations

import torch

__all__ = ["download", "upload"]


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a CPU tensor to ``device`` without blocking; on CPU return it as is."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def download(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor into a fresh pinned host tensor; CPU tensors pass."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
