"""The Llama family: Llama (incl. Llama-3 RoPE scaling, SmolLM), Mistral, Qwen2, Qwen3.

One decoder covers them: GQA, RoPE, RMSNorm, SiLU-gated MLP; Qwen2 adds q/k/v biases,
Qwen3 RMSNorm on q and k per head. Parameter names follow HF so checkpoints map 1:1, except
that q/k/v and gate/up are merged into one matmul each (``qkv_proj``, ``gate_up_proj``).
The projections are tensor-parallel layers (linear.py): each rank holds its heads' rows of
qkv_proj and gate_up_proj and the matching columns of o_proj and down_proj; the parameters'
weight loaders cut a rank's shard out of the checkpoint tensors.

The model runs on a flat batch of tokens ([T], any mix of prefill chunks and decode tokens);
attention goes through the backend with the paged KV cache of each layer.

With FP8 linear layers the two norms and SiLU-and-mul hand the next layer its input already
quantized: each is built with ``fp8_out=<that layer>.takes_fp8_input`` (fp8_activation.py),
and qkv_proj, gate_up_proj and down_proj then get a ``QuantizedActivation``, not a tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from tokenmill.engine.attention.backend import AttentionBackend
from tokenmill.engine.attention.graph_split import attend
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.models import cpu_linear
from tokenmill.engine.models.fp8_activation import QuantizedActivation
from tokenmill.engine.models.layers import RMSNorm, silu_and_mul
from tokenmill.engine.models.linear import MergedColumnParallelLinear, RowParallelLinear
from tokenmill.engine.models.rope import RopeStep, RotaryEmbedding, apply_rope
from tokenmill.engine.models.weight_loader import weight_loader_of
from tokenmill.engine.parallel import ParallelConfig

log = logging.getLogger(__name__)


class LlamaAttention(torch.nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        fused: bool,
        parallel: ParallelConfig,
    ):
        super().__init__()
        # This rank's heads; q/k/v rows are split by whole heads.
        self.n_heads = parallel.per_rank(config.num_attention_heads, "num_attention_heads")
        self.n_kv = parallel.per_rank(config.num_key_value_heads, "num_key_value_heads")
        self.head_dim = d = config.head_dim
        self.q_size = self.n_heads * d
        self.kv_size = self.n_kv * d
        q_out = config.num_attention_heads * d  # rows of the checkpoint's q_proj
        kv_out = config.num_key_value_heads * d  # rows of k_proj and v_proj
        self.qkv_proj = MergedColumnParallelLinear(
            config.hidden_size, (q_out, kv_out, kv_out), config.attention_bias, parallel=parallel
        )
        self.o_proj = RowParallelLinear(q_out, config.hidden_size, parallel=parallel)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, fused) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, fused) if config.qk_norm else None
        self.backend = backend
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        rope: RopeStep,
        x: torch.Tensor | QuantizedActivation,
        kv_cache: torch.Tensor,
        meta: Any,
    ):
        hq, hkv = self.n_heads, self.n_kv
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) d]
        t = qkv.shape[0]
        qkv = qkv.view(t, hq + 2 * hkv, self.head_dim)  # [T, Hq + 2 Hkv, d]
        v = qkv[:, hq + hkv :]  # [T, Hkv, d]
        slots = None  # where the rope kernel stores K/V (None: the attention backend does)
        if self.q_norm is not None:
            q, k = rope.rotate(self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq : hq + hkv]))
        elif rope.fused:
            slots = self.backend.rope_kv_slots(meta)
            kv = None if slots is None else (v, kv_cache, slots)
            q, k = rope.rotate(qkv[:, :hq], qkv[:, hq : hq + hkv], kv)  # in place, in qkv
        else:
            qk = apply_rope(qkv[:, : hq + hkv], rope.cos, rope.sin)  # q and k in one pass
            q, k = qk[:, :hq], qk[:, hq:]
        o = attend(self.backend, q, k, v, kv_cache, meta, self.scale, kv_stored=slots is not None)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(torch.nn.Module):
    def __init__(self, config: ModelConfig, fused: bool, parallel: ParallelConfig) -> None:
        super().__init__()
        self.fused = fused
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, (inter, inter), parallel=parallel
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, parallel=parallel)
        # SiLU-and-mul writes its output as down_proj takes it (FP8 rows for an FP8 layer).
        self.act_fp8_out = self.down_proj.takes_fp8_input

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.fused, self.act_fp8_out))


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        fused: bool,
        parallel: ParallelConfig,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, fused, parallel)
        self.mlp = LlamaMLP(config, fused, parallel)
        eps, hidden = config.rms_norm_eps, config.hidden_size
        # Each norm writes its output as its consumer takes it (FP8 rows for an FP8 layer).
        qkv_fp8 = self.self_attn.qkv_proj.takes_fp8_input
        mlp_fp8 = self.mlp.gate_up_proj.takes_fp8_input
        self.input_layernorm = RMSNorm(hidden, eps, fused, fp8_out=qkv_fp8)
        self.post_attention_layernorm = RMSNorm(hidden, eps, fused, fp8_out=mlp_fp8)

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
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        fused: bool,
        parallel: ParallelConfig,
    ):
        super().__init__()
        # Built with its (empty) weight: Embedding's own random init would run on the meta
        # device through torch._refs, whose first use imports torch._dynamo (3.7 s a process)
        # for values that loading overwrites anyway.
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = torch.nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(config, backend, fused, parallel)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.fused = fused
        self.rope = RotaryEmbedding(config, max_positions)


# merged module -> the HF projections it stacks, in part (shard id) order
_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# HF projection -> (merged module, shard id)
_PART_OF = {part: (merged, i) for merged, parts in _MERGED.items() for i, part in enumerate(parts)}


class LlamaForCausalLM(torch.nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states; ``compute_logits`` the logits.

    With the Triton attention backend the norms, RoPE and SiLU-and-mul run as fused Triton
    kernels too; with the torch backend everything is plain torch (the reference path).
    ``parallel`` is this rank's place in the tensor-parallel group (rank 0 of 1 by default);
    the embeddings and the LM head are held whole by every rank.
    """

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        parallel: ParallelConfig | None = None,
    ):
        super().__init__()
        self.config = config
        self.parallel = parallel or ParallelConfig()
        self.model = LlamaModel(
            config, backend, max_positions, fused=backend.fused_layers, parallel=self.parallel
        )
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
        """The logits in the model's dtype: the sampler converts them to float32 where it
        computes with them (sampling, logprobs, penalties) and takes a greedy argmax as they
        are (the conversion is exact), so no [N, V] float32 copy is made for that."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return cpu_linear.linear(hidden, weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "") -> None:
        """Hand each HF-named tensor to its parameter's ``weight_loader``; q/k/v and gate/up
        go to the merged parameter with their part index as the shard id. Every tensor the
        model needs must come.

        Raises ValueError naming the tensor (and ``source``) on an unknown name or a shape
        mismatch, or listing the tensors the checkpoint never provided.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unused = 0
        where = f" in {source}" if source else ""
        stored_head: torch.Tensor | None = None
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                stored_head = tensor  # tied checkpoints sometimes still store the head
                continue
            if "rotary_emb.inv_freq" in name:
                continue
            param_name, shard_id = _param_name(name)
            param = params.get(param_name)
            if param is None and _ignorable(name, tensor, param_name, params):
                unused += 1
                continue
            if param is None:
                raise ValueError(
                    f"unexpected weight {name}{where}: the model as its config.json describes "
                    "it has no such parameter (a feature this engine does not implement, or "
                    "a config that does not match the weights)"
                )
            try:
                weight_loader_of(param)(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"weight {name}{where} {e}") from None
            loaded.add(name)
        if unused:
            log.info(
                "%d tensors%s left unused: calibrated KV-cache scales, all-zero biases",
                unused,
                where,
            )
        missing = [n for p in params for n in _checkpoint_names(p) if n not in loaded]
        if missing:
            raise ValueError(
                f"checkpoint{where} lacks weights: {', '.join(missing[:8])}"
                + (" ..." if len(missing) > 8 else "")
            )
        if stored_head is not None:
            _check_tied_head(stored_head, self.model.embed_tokens.weight, where)
        _check_finite(params, where)


_KV_SCALES = ("k_scale", "v_scale", "kv_scale")
_CHECKED_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # checked through float32 (e4m3 has NaN)


def _check_tied_head(head: torch.Tensor, embeddings: torch.Tensor, where: str) -> None:
    """config.json ties the LM head to the embeddings, yet the checkpoint stores a head of
    its own: used as the embeddings (the engine builds no head), unless they differ, which
    is refused rather than run with the wrong head."""
    if head.dtype not in _CHECKED_FLOATS or head.shape != embeddings.shape:
        return
    if not torch.equal(head.to(embeddings.device, embeddings.dtype), embeddings.data):
        raise ValueError(
            f"config.json sets tie_word_embeddings true{where}, but the checkpoint's "
            "lm_head.weight differs from its embeddings: set tie_word_embeddings to false "
            "in config.json (the head is the model's own), or remove lm_head.weight"
        )


def _check_finite(params: dict[str, torch.nn.Parameter], where: str) -> None:
    """Refuse NaN or infinite weights, naming the parameter: every row computed from them
    came out empty or garbage, and was written as a result."""
    for name, param in params.items():
        values = param.float() if param.dtype in _FLOAT8 else param
        if values.dtype in _CHECKED_FLOATS and not bool(torch.isfinite(values).all()):
            raise ValueError(
                f"weight {name}{where} holds NaN or infinite values: the checkpoint is "
                "damaged (or overflowed on conversion); re-download or re-export it"
            )


def _ignorable(
    name: str, tensor: torch.Tensor, param_name: str, params: dict[str, torch.nn.Parameter]
) -> bool:
    """Tensors without a parameter that change nothing when left out: calibrated FP8
    KV-cache scales (this engine's FP8 KV cache stores K and V unscaled; the bf16 cache
    needs none), and all-zero biases of layers built without one (older GPTQ exports
    write them)."""
    module, _, leaf = param_name.rpartition(".")
    if leaf in _KV_SCALES:
        return True
    has_layer = any(p.startswith(module + ".") for p in params)
    return leaf == "bias" and has_layer and not bool(tensor.any())


def _param_name(name: str) -> tuple[str, int | None]:
    """HF tensor name -> (parameter name, shard id): ``...self_attn.k_proj.weight`` ->
    (``...self_attn.qkv_proj.weight``, 1); names of unmerged tensors map to themselves."""
    module_path, _, leaf = name.rpartition(".")
    parent, _, proj = module_path.rpartition(".")
    if proj in _PART_OF:
        merged, shard_id = _PART_OF[proj]
        return f"{parent}.{merged}.{leaf}", shard_id
    return name, None


def _checkpoint_names(param_name: str) -> list[str]:
    """The HF tensor names that fill parameter ``param_name`` (one per merged part)."""
    module_path, _, leaf = param_name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    if module in _MERGED:
        return [f"{parent}.{part}.{leaf}" for part in _MERGED[module]]
    return [param_name]
