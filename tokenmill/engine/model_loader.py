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
from tokenmill.engine.seeds import generator_seed


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
    model = _allocated(model, device)
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


def _allocated(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``_to_empty``; a model whose parameters do not fit ``device`` raises ValueError with
    their size (a config.json whose sizes do not belong to its weights asks for terabytes)."""
    try:
        return _to_empty(model, device)
    except (RuntimeError, MemoryError) as exc:
        if not isinstance(exc, (MemoryError, torch.OutOfMemoryError)) and "alloc" not in str(exc):
            raise
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        raise ValueError(
            f"its parameters, {size / 2**30:,.1f} GiB by the config's sizes, do not fit in "
            f"{device.type} memory ({str(exc).splitlines()[0][:120]}); check the config's "
            "sizes (hidden_size, intermediate_size, num_hidden_layers, vocab_size) against "
            "the weights"
        ) from None


def _to_empty(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """What ``model.to_empty(device=device)`` does, keeping the attributes its parameters
    carry (weight loaders, sharded dims) on the new Parameter objects.

    Each tensor is allocated from its shape and dtype alone: ``to_empty`` runs
    ``empty_like`` on every meta tensor, whose Python meta kernels import torch's symbolic
    shapes machinery on first use (1.5 s of every process that builds a model).
    """
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            fresh = torch.nn.Parameter(_empty_as(param, device), param.requires_grad)
            fresh.__dict__.update(param.__dict__)
            module._parameters[name] = fresh
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = _empty_as(buffer, device)
    return model


def _empty_as(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device=device)


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
                gens[param.device] = torch.Generator(device=param.device).manual_seed(
                    generator_seed(seed, param.device.type)
                )
            if param.is_floating_point():
                param.normal_(0, 0.02, generator=gens[param.device])
            else:
                low = -128 if param.dtype == torch.int8 else 0
                param.random_(low, low + 256, generator=gens[param.device])
