"""Rotary position embeddings (HF rotate-half layout) with Llama-3 and linear scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenmill.engine.model_config import ModelConfig
from tokenmill.kernels.rotate_half import apply_rope


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, after the config's rope scaling."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if config.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin of every position up to ``max_positions``.

    cos, sin: [max_positions, head_dim // 2]. ``lookup`` runs once per step; ``apply_rope``
    then rotates q and k of every layer with the same tables.
    """

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        shape = (max_positions, config.head_dim // 2)
        self.register_buffer("cos", torch.empty(shape), persistent=False)
        self.register_buffer("sin", torch.empty(shape), persistent=False)
        device = self.cos.device  # the current default device (meta while building)
        # On meta, only the shapes: build_model computes the tables once the model has a
        # device (arithmetic on meta tensors runs torch._refs, which imports torch._dynamo).
        if device.type != "meta":
            self.build(device)

    def build(self, device: torch.device) -> None:
        """(Re)compute the tables on ``device``, e.g. after the model was built on ``meta``."""
        with torch.device(device):
            inv_freq = rope_inv_freq(self.config)
            positions = torch.arange(self.max_positions, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # [P, d/2]
            self.cos = freqs.cos()
            self.sin = freqs.sin()

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype, fused: bool) -> RopeStep:
        """What every layer needs to rotate this step's q and k (computed once per step)."""
        if fused:
            return RopeStep(positions, self.cos, self.sin, fused=True)
        cos, sin = self.lookup(positions, dtype)
        return RopeStep(positions, cos, sin, fused=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``positions`` [T]: each [T, 1, d/2], broadcastable over heads."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


@dataclass(frozen=True)
class RopeStep:
    """One step's rotation inputs: the full tables for the Triton kernel (which indexes them
    by position itself), or the tables already looked up at ``positions`` ([T, 1, d/2])."""

    positions: torch.Tensor  # [T]
    cos: torch.Tensor
    sin: torch.Tensor
    fused: bool

    def rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q [T, Hq, d], k [T, Hkv, d]); the fused kernel rotates them in place, and
        with ``kv`` = (v, kv_cache, slot_mapping) also stores the rotated k and v in the cache
        (kernels/rope.py; the fused kernel only)."""
        if self.fused:
            from tokenmill.kernels.rope import rope_

            rope_(q, k, self.positions, self.cos, self.sin, kv)
            return q, k
        if kv is not None:
            raise ValueError("RopeStep.rotate: only the fused kernel stores K/V (kv given)")
        return apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
