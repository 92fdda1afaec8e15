"""The Llama family: Llama (incl. Llama-3 RoPE scaling, SmolLM), Mistral, Qwen2, Qwen3.

One decoder covers them: GQA, RoPE, RMSNorm, SiLU-gated MLP; Qwen2 adds q/k/v biases,
Qwen3 RMSNorm on q and k per head. Parameter names follow HF so checkpoints map 1:1, except
that q/k/v and gate/up are merged into one matmul each (``qkv_proj``, ``gate_up_proj``).

The model runs on a flat batch of tokens ([T], any mix of prefill chunks and decode tokens);
attention goes through the backend with the paged KV cache of each layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tokenmill.engine.attention.backend import AttentionBackend
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.models.layers import MergedLinear, RMSNorm, silu_and_mul
from tokenmill.engine.models.rope import RopeStep, RotaryEmbedding, apply_rope


class LlamaAttention(torch.nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, fused: bool):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, (self.q_size, self.kv_size, self.kv_size), config.attention_bias
        )
        self.o_proj = torch.nn.Linear(self.q_size, config.hidden_size, bias=False)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, fused) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, fused) if config.qk_norm else None
        self.backend = backend
        self.scale = self.head_dim**-0.5

    def forward(self, rope: RopeStep, x: torch.Tensor, kv_cache: torch.Tensor, meta: Any):
        t = x.shape[0]
        hq, hkv = self.n_heads, self.n_kv
        qkv = self.qkv_proj(x).view(t, hq + 2 * hkv, self.head_dim)  # [T, Hq + 2 Hkv, d]
        v = qkv[:, hq + hkv :]  # [T, Hkv, d]
        if self.q_norm is not None:
            q, k = rope.rotate(self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq : hq + hkv]))
        elif rope.fused:
            q, k = rope.rotate(qkv[:, :hq], qkv[:, hq : hq + hkv])  # in place, in qkv
        else:
            qk = apply_rope(qkv[:, : hq + hkv], rope.cos, rope.sin)  # q and k in one pass
            q, k = qk[:, :hq], qk[:, hq:]
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, Hq, d]
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(torch.nn.Module):
    def __init__(self, config: ModelConfig, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, (inter, inter), bias=False)
        self.down_proj = torch.nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.fused))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, fused: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, fused)
        self.mlp = LlamaMLP(config, fused)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, fused)

    def forward(
        self,
        rope: RopeStep,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (before its residual add); residual: the running
        sum. Returns the same pair for the next layer, so each add fuses into a norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(torch.nn.Module):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, max_positions: int, fused: bool
    ):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(config, backend, fused) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.fused = fused
        self.rope = RotaryEmbedding(config, max_positions)


# HF parameter name suffix -> (merged module attribute, part index)
_MERGED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(torch.nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states; ``compute_logits`` the logits.

    With the Triton attention backend the norms, RoPE and SiLU-and-mul run as fused Triton
    kernels too; with the torch backend everything is plain torch (the reference path).
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend, max_positions, fused=backend.fused_layers)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        attn_meta: Any,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rope.prepare(positions, x.dtype, self.model.fused)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(rope, x, residual, kv_cache, attn_meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "") -> None:
        """Copy HF-named tensors into the parameters; every parameter must be filled once.

        Raises ValueError naming the tensor (and ``source``) on an unknown name, a shape
        mismatch, or parameters the checkpoint never provided.
        """
        params = dict(self.named_parameters())
        filled: set[str] = set()
        where = f" in {source}" if source else ""
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes still store the head
            if "rotary_emb.inv_freq" in name:
                continue
            module_path, _, leaf = name.rpartition(".")
            parent, _, proj = module_path.rpartition(".")
            if proj in _MERGED_PARTS:
                merged, index = _MERGED_PARTS[proj]
                target = f"{parent}.{merged}.{leaf}"
                if target not in params:
                    raise ValueError(f"unexpected weight {name}{where}")
                module = self.get_submodule(f"{parent}.{merged}")
                module.load_part(index, name, tensor, is_bias=leaf == "bias")
                filled.add(f"{target}#{index}")
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name}{where}")
            param = params[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"weight {name}{where} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            filled.add(name)
        missing = [n for n in params if not self._is_filled(n, filled)]
        if missing:
            raise ValueError(
                f"checkpoint{where} lacks weights: {', '.join(missing[:8])}"
                + (" ..." if len(missing) > 8 else "")
            )

    def _is_filled(self, name: str, filled: set[str]) -> bool:
        module_path = name.rpartition(".")[0]
        module = self.get_submodule(module_path)
        if isinstance(module, MergedLinear):
            return all(f"{name}#{i}" in filled for i in range(len(module.part_sizes)))
        return name in filled
