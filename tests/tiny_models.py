"""Tiny random HF models of every supported architecture, saved at test time, fully offline.

    path = save_tiny_model("qwen3", tmp_path / "m", tie_word_embeddings=True)
    path/config.json, model.safetensors (or shards), tokenizer.json, tokenizer_config.json,
    chat template

Shapes (overridable by config keyword): vocab 288, hidden 64, intermediate 128, 2 layers,
4 query heads / 2 KV heads, head_dim 16 (Qwen3: 32, as real Qwen3 decouples it from hidden).
Every parameter is random, norms and biases included, so a swapped or dropped tensor changes
the output. The tokenizer is byte-level BPE over the 256 byte symbols plus specials: any text
round-trips. Other engine tests import this module: keep its signatures stable.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

__all__ = [
    "TINY_ARCHITECTURES",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "tiny_config",
    "save_tiny_model",
    "save_tiny_tokenizer",
]

# short name -> (HF architecture, config class)
TINY_ARCHITECTURES: dict[str, tuple[str, type[PretrainedConfig]]] = {
    "llama": ("LlamaForCausalLM", LlamaConfig),
    "mistral": ("MistralForCausalLM", MistralConfig),
    "qwen2": ("Qwen2ForCausalLM", Qwen2Config),
    "qwen3": ("Qwen3ForCausalLM", Qwen3Config),
}

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")  # ids 0..4
BOS_ID, EOS_ID = 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_BASE: dict[str, Any] = {
    "vocab_size": 288,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}
_PER_ARCH: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"head_dim": 32, "use_sliding_window": False},
}


def tiny_config(arch: str, **overrides: Any) -> PretrainedConfig:
    """The HF config of a tiny ``arch`` model ("llama", "mistral", "qwen2", "qwen3").

    ``overrides`` are config keywords, e.g. ``tie_word_embeddings=True`` or
    ``rope_scaling={"rope_type": "llama3", "factor": 8.0, ...}``.
    """
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {', '.join(TINY_ARCHITECTURES)}")
    architecture, config_cls = TINY_ARCHITECTURES[arch]
    # transformers edits dicts it is given (rope_scaling gains rope_theta): pass copies.
    kwargs = copy.deepcopy({**_BASE, **_PER_ARCH[arch], **overrides})
    return config_cls(architectures=[architecture], **kwargs)


def save_tiny_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """Save a byte-level BPE tokenizer (261 tokens) with ``CHAT_TEMPLATE`` to ``path``."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return tokenizer


@torch.no_grad()
def save_tiny_model(
    arch: str,
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
    **overrides: Any,
) -> Path:
    """Build a random tiny ``arch`` model and save it with a tokenizer as an HF directory.

    Takes the architecture short name, the target directory (created), a seed, the saved
    dtype, an optional ``max_shard_size`` (e.g. "100KB") for a sharded save, and config
    overrides (see ``tiny_config``). Returns the directory as a Path. Weights are safetensors.
    """
    path = Path(path)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        # Norm weights near 1 keep activations sane; everything else small, like an init.
        param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
    model.to(dtype)
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **save_kwargs)
    save_tiny_tokenizer(path)
    return path
