"""HF ``architectures`` name -> model class."""

from __future__ import annotations

import torch

from tokenmill.engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from tokenmill.engine.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
assert set(_REGISTRY) == set(SUPPORTED_ARCHITECTURES)  # a developer check, not user input


def model_class(config: ModelConfig) -> type[torch.nn.Module]:
    try:
        return _REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {config.architecture!r}; supported: {', '.join(_REGISTRY)}"
        ) from None
