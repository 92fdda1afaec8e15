"""Host <-> device copies that never block the host on the GPU.

A non-blocking copy from pageable memory may make the driver wait for the stream; staging
through pinned memory lets the host go on scheduling the next step while the GPU works.
PyTorch's pinned allocator keeps a staging buffer until the copy that reads it has run.
A step's many small inputs go together instead, through upload_ring.py.

    upload(host)        host [..] -> pinned -> device (non_blocking)
    download(t)         device [..] -> new pinned host tensor (non_blocking); read it only
                        after an event recorded behind the copy has completed
    record_event(dev)   a CUDA event recorded on the current stream of ``dev``

``torch.cuda.Event.record()`` without a stream looks the current device up through
``torch.cuda``'s Python helpers (device attribute, availability, index checks) before it
asks for the current stream: ~15-35 us a call on the H200 hosts in a py-spy profile (session
19), and a step recorded three or four events. ``record_event`` asks for the stream of a
known device index instead.
"""

from __future__ import annotations

import torch

__all__ = ["current_stream", "download", "record_event", "upload"]


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


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """The current stream of CUDA ``device`` (of the current device when it has no index),
    asked for by index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.current_stream(index)


def record_event(device: torch.device) -> torch.cuda.Event:
    """A new event recorded on the current stream of CUDA ``device``."""
    event = torch.cuda.Event()
    event.record(current_stream(device))
    return event
