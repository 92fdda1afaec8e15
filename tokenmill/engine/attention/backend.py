"""The attention backend registry: a backend by name, and the default for a device.

The interface every backend implements is ``interface.AttentionBackend`` (re-exported here).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tokenmill.engine.attention.interface import AttentionBackend
from tokenmill.engine.engine_config import EngineSettingError
from tokenmill.kernels.paged_inputs import HEAD_DIMS, takes_head_dim

__all__ = [
    "AttentionBackend",
    "check_backend_takes",
    "default_backend_name",
    "get_attention_backend",
]

log = logging.getLogger(__name__)


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


def default_backend_name(device: torch.device, head_dim: int) -> str:
    """Triton kernels on CUDA where they take the model's head dim, the torch reference
    elsewhere (with a warning on CUDA: it is slower)."""
    if device.type != "cuda":
        return "torch"
    if takes_head_dim(head_dim):
        return "triton"
    log.warning(
        "head dim %d: the Triton attention kernels take %s; attention runs in the torch "
        "backend (slower)", head_dim, HEAD_DIMS,
    )  # fmt: skip
    return "torch"


def check_backend_takes(name: str, head_dim: int) -> None:
    """Raise EngineSettingError when backend ``name`` cannot run a model of ``head_dim``."""
    if name == "triton" and not takes_head_dim(head_dim):
        raise EngineSettingError(
            "attention_backend",
            name,
            f"auto or torch for this model: its head dim is {head_dim}, and the Triton "
            f"attention kernels take {HEAD_DIMS}",
        )
