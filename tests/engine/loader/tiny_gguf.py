"""A minimal stand-in for llama.cpp's convert_hf_to_gguf.py, for tiny test models.

Same metadata keys, same tensor names, same q/k row permutation for "llama", same rope_freqs
tensor for Llama-3 rope scaling; tensors are stored as F32 so round trips are exact, or the
linear layers' weights in a block type (``linear_type``: Q4_0, Q4_1, Q8_0), quantized by the
gguf package as llama.cpp would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.tiny_models import CHAT_TEMPLATE

# HF module path -> llama.cpp name, the inverse of what the loader maps.
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: rotate-half rows -> interleaved pairs.
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(config: Any) -> tuple[float, str]:
    # (rope_theta, rope_type); transformers 5 keeps both in rope_parameters.
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = getattr(config, "rope_theta", None) or params["rope_theta"]
    return float(theta), str(params.get("rope_type", "default"))


def _llama3_rope_freqs(config: Any) -> np.ndarray:
    # Derived from transformers' own llama3 rope, independently of the loader's formula.
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = config.head_dim
    theta, _ = _rope(config)
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return (base / scaled.double()).numpy().astype(np.float32)


def tokenizer_metadata(hf_dir: Path) -> Callable[[gguf.GGUFWriter], None]:
    """An ``extra`` for write_tiny_gguf that stores the tiny byte-level BPE tokenizer of
    ``hf_dir`` (tests/tiny_models.py) as llama.cpp's ``tokenizer.ggml.*`` metadata, so that
    the file runs in an engine on its own."""
    saved = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = saved["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["id"] for t in saved["added_tokens"]}

    def add(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_merges([])
        writer.add_chat_template(CHAT_TEMPLATE)

    return add


def write_tiny_gguf(
    hf_dir: Path,
    out: Path,
    gguf_arch: str | None = None,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
    linear_type: str = "F32",
) -> Path:
    """Convert tiny HF directory ``hf_dir`` to a GGUF file ``out`` the way llama.cpp does.

    ``gguf_arch`` defaults from the HF model type (mistral -> "llama"); ``extra`` may add
    metadata or tensors before the file is written; ``linear_type`` is the type of the
    linear layers' weights (``*_proj.weight``), F32 or a block type. Returns ``out``.
    """
    config = AutoConfig.from_pretrained(hf_dir)
    rope_theta, rope_type = _rope(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    arch = gguf_arch or {"mistral": "llama"}.get(config.model_type, config.model_type)
    writer = gguf.GGUFWriter(out, arch)
    writer.add_uint32(f"{arch}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{arch}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{arch}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{arch}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{arch}.rope.freq_base", rope_theta)
    writer.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_uint32(f"{arch}.attention.key_length", head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    writer.add_uint32("tokenizer.ggml.bos_token_id", config.bos_token_id)
    writer.add_uint32("tokenizer.ggml.eos_token_id", config.eos_token_id)
    if rope_type == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(config))

    files = sorted(hf_dir.glob("*.safetensors"))
    state = {k: v for f in files for k, v in load_file(f).items()}
    for name, tensor in state.items():
        w = tensor.float().numpy()
        module, kind = name.rsplit(".", 1)
        if module.startswith("model.layers."):
            _, _, layer, rest = module.split(".", 3)
            part = _GGUF_LAYER_NAMES[rest]
            if arch == "llama" and part == "attn_q":
                w = _llama_cpp_permute(w, config.num_attention_heads)
            if arch == "llama" and part == "attn_k":
                w = _llama_cpp_permute(w, config.num_key_value_heads)
            gguf_name = f"blk.{layer}.{part}.{kind}"
        else:
            gguf_name = f"{_GGUF_GLOBAL_NAMES[module]}.{kind}"
        if linear_type != "F32" and name.endswith("_proj.weight"):
            kind = gguf.GGMLQuantizationType[linear_type]
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
