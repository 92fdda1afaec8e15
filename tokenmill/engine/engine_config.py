"""EngineConfig: how one engine replica runs, validated when built."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tokenmill.engine.model_config import ModelConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
DEFAULT_CPU_KV_BYTES = 2 << 30
DEFAULT_GPU_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Raises ValueError naming the key when a value is out of range.

    ``kv_cache_memory``: bytes (int) or a fraction of the device's memory (float in (0, 1]);
    None means 2 GiB on CPU and 90% of the GPU's memory (less weights and activations).
    ``max_num_batched_tokens`` is the per-step token budget; prompts longer than it are
    prefilled in chunks. ``cuda_graphs`` captures decode steps (CUDA with the Triton backend).
    ``load_format="random"`` builds the model from ``config.json`` alone with random weights
    and no tokenizer (prompts must be token ids): for throughput benchmarks of real shapes.
    ``profile_steps`` records per-step CPU and GPU time (``LLMEngine.step_profile()``).
    ``async_scheduling`` schedules step n+1 while the device runs step n (None: on CUDA only,
    where it hides the host's work; on CPU the host is the device, so nothing overlaps).
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | float | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    load_format: str = "auto"  # "random": config.json only, N(0, 0.02) weights (benchmarks)
    profile_steps: bool = False
    async_scheduling: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for key in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )
        if self.load_format not in ("auto", "random"):
            raise ValueError(f"load_format must be auto or random, got {self.load_format!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        mem = self.kv_cache_memory
        if mem is not None:
            if isinstance(mem, bool) or not isinstance(mem, (int, float)):
                raise ValueError(f"kv_cache_memory must be bytes or a fraction, got {mem!r}")
            if isinstance(mem, float) and not 0 < mem <= 1:
                raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {mem}")
            if isinstance(mem, int) and mem <= 0:
                raise ValueError(f"kv_cache_memory in bytes must be positive, got {mem}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but no CUDA GPU is visible; use device=cpu")
        return device

    def resolve_async_scheduling(self, device: torch.device) -> bool:
        if self.async_scheduling is None:
            return device.type == "cuda"
        return self.async_scheduling

    def resolve_dtype(self, model_config: ModelConfig, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32
        stored = _DTYPES.get(model_config.torch_dtype.replace("torch.", ""), torch.bfloat16)
        return torch.bfloat16 if stored == torch.float32 else stored

    def kv_cache_budget(self, device: torch.device, reserve_bytes: int = 0) -> int:
        """Bytes for the KV cache on ``device``, after ``reserve_bytes`` for activations."""
        mem = self.kv_cache_memory
        if isinstance(mem, int):
            return mem
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            fraction = DEFAULT_GPU_MEMORY_FRACTION if mem is None else mem
            return int(fraction * total) - (total - free) - reserve_bytes
        if mem is None:
            return DEFAULT_CPU_KV_BYTES
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(mem * total)
