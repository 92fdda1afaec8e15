"""The attention backend registry: a backend by name, and the default for a device.

The interface every backend implements is ``interface.AttentionBackend`` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.engine.attention.interface import AttentionBackend

__all__ = ["AttentionBackend", "default_backend_name", "get_attention_backend"]


def _torch_backend(num_kv_heads: int) -> AttentionBackend:
    from tokenmill.engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _triton_backend(num_kv_heads: int) -> AttentionBackend:
    from tokenmill.engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(num_kv_heads)


# name -> factory(num_kv_heads); imported lazily so the CPU path never needs Triton.
_BACKENDS: dict[str, Callable[[int], AttentionBackend]] = {
    "torch": _torch_backend,
    "triton": _triton_backend,
}


def get_attention_backend(name: str, num_kv_heads: int) -> AttentionBackend:
    """Backend by name for a model with ``num_kv_heads``; ValueError lists the known ones."""
    factory = _BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(_BACKENDS)}")
    return factory(num_kv_heads)


def default_backend_name(device: torch.device) -> str:
    """Triton kernels on CUDA, the torch reference elsewhere."""
    return "triton" if device.type == "cuda" else "torch"
