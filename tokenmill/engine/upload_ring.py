"""A step's small host arrays sent to the device in one copy, through reused pinned memory.

A decode step needs a dozen small arrays on the device (token ids, positions, KV slots,
sequence lengths, block tables, sampling settings). Uploading each one pins a fresh staging
buffer and starts a copy of its own; at a few hundred rows that per-array cost is a visible
share of the host's step. ``UploadRing.upload(arrays)`` packs the arrays into one pinned
buffer, starts one host-to-device copy, and hands back typed views of the device buffer:

    arrays   a [5] int64   b [2, 3] int32   c [7] bool
    pinned   | a ....... |pad| b ..... |pad| c .. |        offsets aligned to ALIGN bytes
    device   | a ....... |   | b ..... |   | c .. |        one copy_, non-blocking
    views    dev[0:40].view(int64)  dev[64:88].view(int32).view(2, 3)  dev[128:135].view(bool)

The ring has ``depth`` slots (a pinned buffer and a device buffer each, grown when a call
needs more), used in turn. A slot's pinned buffer is written again only after the copy that
last read it has finished (an event per slot); its device buffer is overwritten by a copy on
the same stream, so after every kernel enqueued before that copy. The views of one call stay
valid for the next ``depth - 1`` calls: every reader of a step's inputs is enqueued by then.
Off CUDA, ``upload`` returns the arrays as CPU tensors that share their memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tokenmill.engine.device_copy import record_event

__all__ = ["ALIGN", "UploadRing"]

ALIGN = 64  # bytes: every view starts at a multiple of this (any dtype's alignment)


class _Slot:
    """One pinned host buffer, its device twin, and the event behind its last copy."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host_np = self.host.numpy()
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.copied: torch.cuda.Event | None = None


class UploadRing:
    """Uploads groups of host arrays, one copy per group (see the module docstring)."""

    def __init__(self, device: torch.device, depth: int = 4, initial_bytes: int = 1 << 16):
        if depth < 2:
            raise ValueError(f"UploadRing needs depth >= 2, got {depth}")
        self.device = torch.device(device)
        self.depth = depth
        self._slots: list[_Slot | None] = [None] * depth
        self._next = 0
        self._initial_bytes = initial_bytes
        self.calls = 0  # uploads so far: a call's views are valid until calls - it >= depth

    def views_valid(self, call: int) -> bool:
        """Whether the views returned by upload call number ``call`` (``calls`` right after
        it) still hold their data: fewer than ``depth`` calls have been made since."""
        return self.device.type != "cuda" or self.calls - call < self.depth

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """The arrays on the device (same shapes and dtypes), sent in one non-blocking copy."""
        self.calls += 1
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, total = _layout(arrays)
        slot = self._take(total)
        for a, offset in zip(arrays, offsets, strict=True):
            if a.nbytes:
                flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                slot.host_np[offset : offset + a.nbytes] = flat
        slot.device[:total].copy_(slot.host[:total], non_blocking=True)
        slot.copied = record_event(self.device)
        return [
            slot.device[offset : offset + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
            for a, offset in zip(arrays, offsets, strict=True)
        ]

    def upload_groups(self, *groups: Sequence[np.ndarray]) -> list[list[torch.Tensor]]:
        """Several groups of arrays in one copy: their device views, group by group."""
        views = self.upload([a for group in groups for a in group])
        out, start = [], 0
        for group in groups:
            out.append(views[start : start + len(group)])
            start += len(group)
        return out

    def _take(self, nbytes: int) -> _Slot:
        """The next slot, its last copy finished, with room for ``nbytes``."""
        i = self._next
        self._next = (i + 1) % self.depth
        slot = self._slots[i]
        if slot is not None and slot.copied is not None:
            slot.copied.synchronize()  # normally long done: depth - 1 calls ago
        if slot is None or slot.host.numel() < nbytes:
            size = max(self._initial_bytes, 1 << max(nbytes - 1, 1).bit_length())
            slot = self._slots[i] = _Slot(size, self.device)
        return slot


def _layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Each array's byte offset in the packed buffer, and the bytes used."""
    offsets = []
    end = 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.nbytes // ALIGN) * ALIGN
    return offsets, max(end, ALIGN)


_DTYPES: dict[np.dtype, torch.dtype] = {}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    known = _DTYPES.get(dtype)
    if known is None:
        known = _DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return known
