"""Build a model of a ModelConfig on a device, without paying for random init twice."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from tokenmill.engine.attention.backend import AttentionBackend
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.models.linear import LinearBase
from tokenmill.engine.models.quant_methods import quantized_layers
from tokenmill.engine.models.registry import model_class
from tokenmill.engine.models.rope import RotaryEmbedding
from tokenmill.engine.parallel import ParallelConfig


def build_model(
    config: ModelConfig,
    backend: AttentionBackend,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    weights: Iterable[tuple[str, torch.Tensor]] | None,
    source: str = "",
    seed: int = 0,
    *,
    parallel: ParallelConfig | None = None,
    quantization: str = "none",
) -> torch.nn.Module:
    """The model with ``weights`` loaded, or random weights (std 0.02) when ``weights`` is None.

    Parameters are created in ``dtype`` on the meta device (a layer's quantization method may
    pick another dtype for its own) and materialised once on ``device``. ``parallel`` is this
    rank's place in the tensor-parallel group, rank 0 of 1 by default. ``quantization`` names
    the linear layers' method (quant_methods.py). Raises ValueError (from ``load_weights``)
    naming the tensor on a mismatch.
    """
    with torch.device("meta"), _default_dtype(dtype), quantized_layers(quantization):
        model = model_class(config)(config, backend, max_positions, parallel=parallel)
    model = _to_empty(model, device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build(device)
    if weights is None:
        init_random_weights(model, seed)
    else:
        model.load_weights(weights, source=source)
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.quant_method.process_weights_after_loading(module)
    return model.eval()


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters built inside are ``dtype`` (the layers read ``torch.get_default_dtype()``)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _to_empty(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model.to_empty(device=device)``, keeping the attributes its parameters carry (weight
    loaders, sharded dims): moving off the meta device makes new Parameter objects."""
    attrs = {name: dict(param.__dict__) for name, param in model.named_parameters()}
    model = model.to_empty(device=device)
    for name, param in model.named_parameters():
        param.__dict__.update(attrs[name])
    return model


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic N(0, 0.02) weights, ones for norms, zeros for biases, random bytes for
    integer weights (packed INT4 codes 0..255, INT8 codes -128..127): for benchmarks."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            if param.device not in gens:
                gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            if param.is_floating_point():
                param.normal_(0, 0.02, generator=gens[param.device])
            else:
                low = -128 if param.dtype == torch.int8 else 0
                param.random_(low, low + 256, generator=gens[param.device])
