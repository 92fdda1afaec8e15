"""The HF checkpoint layout the engine's models consume: tensor names and their shapes.

Both loaders check what they yield against this table, so a config that disagrees with its
weights fails at load time with the file and tensor named, not later inside a matmul.
"""

from __future__ import annotations

from tokenmill.engine.model_config import ModelConfig

__all__ = ["expected_shapes", "check_shape"]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor a Llama-family checkpoint may hold.

    Optional tensors (biases, q/k norms, ``lm_head`` when tied) are listed too; this says what
    shape a tensor must have if present, not which tensors must be present.
    """
    v, h, i = config.vocab_size, config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim  # rows of q_proj
    kv_out = config.num_key_value_heads * config.head_dim  # rows of k_proj and v_proj
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
    }
    per_layer: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q_out, h),
        "self_attn.k_proj.weight": (kv_out, h),
        "self_attn.v_proj.weight": (kv_out, h),
        "self_attn.o_proj.weight": (h, q_out),
        "self_attn.q_proj.bias": (q_out,),
        "self_attn.k_proj.bias": (kv_out,),
        "self_attn.v_proj.bias": (kv_out,),
        "self_attn.o_proj.bias": (h,),
        "self_attn.q_norm.weight": (config.head_dim,),
        "self_attn.k_norm.weight": (config.head_dim,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    for layer in range(config.num_hidden_layers):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{suffix}"] = shape
    return shapes


def check_shape(
    name: str,
    shape: tuple[int, ...],
    shapes: dict[str, tuple[int, ...]],
    source: str,
) -> None:
    """Raise ValueError if ``name`` is a known tensor whose ``shape`` disagrees with the config.

    Unknown names pass: the model decides what it does with tensors it does not have.
    """
    want = shapes.get(name)
    if want is not None and tuple(shape) != want:
        raise ValueError(
            f"tensor {name} in {source} has shape {list(shape)}, but the model config implies "
            f"{list(want)}; the config and the weights do not belong together"
        )
