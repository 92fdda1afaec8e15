"""Build a model of a ModelConfig on a device, without paying for random init twice."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tokenmill.engine.attention.backend import AttentionBackend
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.models.registry import model_class
from tokenmill.engine.models.rope import RotaryEmbedding


def build_model(
    config: ModelConfig,
    backend: AttentionBackend,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    weights: Iterable[tuple[str, torch.Tensor]] | None,
    source: str = "",
    seed: int = 0,
) -> torch.nn.Module:
    """The model with ``weights`` loaded, or random weights (std 0.02) when ``weights`` is None.

    Parameters are created on the meta device and materialised once on ``device``.
    Raises ValueError (from ``load_weights``) naming the tensor on a mismatch.
    """
    with torch.device("meta"):
        model = model_class(config)(config, backend, max_positions)
    model = model.to_empty(device=device).to(dtype)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build(device)
    if weights is None:
        init_random_weights(model, seed)
    else:
        model.load_weights(weights, source=source)
    return model.eval()


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic N(0, 0.02) weights, ones for norms, zeros for biases (benchmarks)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            if param.device not in gens:
                gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0, 0.02, generator=gens[param.device])
