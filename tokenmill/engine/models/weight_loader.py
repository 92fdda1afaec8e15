"""Per-parameter weight loaders: each parameter knows how a checkpoint tensor goes into it.

A model's ``load_weights`` maps a checkpoint name to a parameter and a shard id, then calls

    param.weight_loader(param, loaded, shard_id)

so the layer that owns the parameter decides which slice of ``loaded`` its rank keeps and
which rows of ``param`` it fills (linear.py); parameters without a loader (embeddings, norms)
take the whole tensor through ``default_weight_loader``. Loaders raise ValueError saying
``"has shape (...), expected (...)"``; the model prefixes the tensor's name and file.

Parameter attributes a loader reads (set by ``set_weight_attrs``):

    weight_loader  the loader
    output_dim     the dim of output features (sharded by column-parallel layers), or absent
    input_dim      the dim of input features (sharded by row-parallel layers), or absent
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = [
    "WeightLoader",
    "check_shape",
    "default_weight_loader",
    "set_weight_attrs",
    "weight_loader_of",
]


class WeightLoader(Protocol):
    def __call__(
        self, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        """Copy this rank's part of checkpoint tensor ``loaded`` into ``param``.

        ``shard_id`` is the part index in a merged parameter (q/k/v, gate/up), else None.
        Mutates ``param``; raises ValueError on a shape mismatch.
        """
        ...


def default_weight_loader(
    param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
) -> None:
    """Copy all of ``loaded`` into ``param`` (a parameter every rank holds whole)."""
    if shard_id is not None:
        raise ValueError(f"is part {shard_id} of a merged weight, but this parameter has no parts")
    check_shape(loaded, tuple(param.shape))
    param.data.copy_(loaded)


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Raise ValueError ``"has shape (...), expected (...)"`` unless checkpoint tensor
    ``loaded`` has the ``expected`` (unsharded) shape."""
    if tuple(loaded.shape) != expected:
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {expected}")


def set_weight_attrs(param: torch.nn.Parameter, **attrs: Any) -> None:
    """Attach loader attributes (``weight_loader``, ``output_dim``, ``input_dim``) to ``param``.

    ``build_model`` carries them over when it moves the model off the meta device.
    """
    for key, value in attrs.items():
        setattr(param, key, value)


def weight_loader_of(param: torch.nn.Parameter) -> WeightLoader:
    """The loader ``param`` carries, or ``default_weight_loader``."""
    return getattr(param, "weight_loader", default_weight_loader)
