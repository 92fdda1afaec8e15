"""GGUF metadata -> an HF-style ``config.json`` dict, so ModelConfig has one validation path.

general.architecture            = "llama" | "qwen2" | "qwen3"   -> architectures
{arch}.block_count              -> num_hidden_layers
{arch}.embedding_length         -> hidden_size
{arch}.feed_forward_length      -> intermediate_size
{arch}.attention.head_count     -> num_attention_heads
{arch}.attention.head_count_kv  -> num_key_value_heads
{arch}.attention.key_length     -> head_dim (else rope.dimension_count, else hidden / heads)
{arch}.attention.layer_norm_rms_epsilon -> rms_norm_eps
{arch}.rope.freq_base           -> rope_theta
{arch}.context_length           -> max_position_embeddings
{arch}.rope.scaling.*           -> rope_scaling ("linear"; others are passed on and refused)
rope_freqs.weight tensor        -> rope_scaling llama3 (llama.cpp bakes Llama-3 scaling into it)
tokenizer.ggml.{bos,eos,eot,eom}_token_id -> bos_token_id, eos_token_id
token_embd.weight rows          -> vocab_size;  no output.weight -> tie_word_embeddings
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tokenmill.engine.loader.gguf_file import metadata_array_length, metadata_value
from tokenmill.engine.loader.gguf_reader import GGUFFile

__all__ = ["GGUF_ARCHITECTURES", "gguf_hf_config", "llama3_freq_factors"]

# general.architecture -> HF architectures entry. Mistral GGUFs are written as "llama".
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# The Llama-3.1/3.2 values of what the rope_freqs tensor does not pin down by itself.
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192  # unless {arch}.rope.scaling.original_context_length says


def gguf_hf_config(reader: GGUFFile, path: Path) -> dict[str, Any]:
    """Translate the metadata of the GGUF file at ``path`` into an HF config dict.

    Raises ValueError naming the file and the key for an unsupported architecture or a
    missing required key.
    """
    arch = metadata_value(reader, "general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (key general.architecture) in {path}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def get(key: str) -> Any:
        value = metadata_value(reader, f"{arch}.{key}")
        if isinstance(value, list):
            raise ValueError(
                f"GGUF metadata key {arch}.{key} in {path} is a per-layer list; "
                "only models with the same value in every layer are supported"
            )
        return value

    def typed(key: str, kinds: tuple[type, ...], what: str, required: bool) -> Any:
        value = get(key)
        if value is None and required:
            raise ValueError(f"GGUF metadata key {arch}.{key} is missing in {path}")
        return _checked(value, f"{arch}.{key}", kinds, what, path)

    def whole(key: str, required: bool = True) -> int | None:
        return typed(key, (int,), "an integer", required)

    def real(key: str, required: bool = True) -> float | None:
        value = typed(key, (int, float), "a number", required)
        return None if value is None else float(value)

    tensors = {t.name: t for t in reader.tensors}
    hidden = whole("embedding_length")
    n_heads = whole("attention.head_count")
    n_kv_heads = whole("attention.head_count_kv", False) or n_heads
    head_dim = (
        whole("attention.key_length", False)
        or whole("rope.dimension_count", False)
        or hidden // max(n_heads, 1)
    )
    rope_theta = real("rope.freq_base", False) or 10000.0
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": _vocab_size(reader, tensors, arch, path),
        "hidden_size": hidden,
        "intermediate_size": whole("feed_forward_length"),
        "num_hidden_layers": whole("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": real("attention.layer_norm_rms_epsilon"),
        "rope_theta": rope_theta,
        "max_position_embeddings": whole("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "rope_scaling": _rope_scaling(reader, tensors, arch, head_dim, rope_theta, path),
        "bos_token_id": _token_id(reader, "bos", path),
        "eos_token_id": _eos_token_ids(reader, path),
        # iter_weights dequantizes every tensor to float32.
        "torch_dtype": "float32",
    }


def _vocab_size(reader: GGUFFile, tensors: dict[str, Any], arch: str, path: Path) -> int:
    # The embedding's rows are what the weights need; the token list can be shorter (padding).
    embedding = tensors.get("token_embd.weight")
    if embedding is not None:
        return int(embedding.shape[-1])  # GGUF shape is [hidden, vocab]
    size = metadata_value(reader, f"{arch}.vocab_size")
    size = size or metadata_array_length(reader, "tokenizer.ggml.tokens")
    if not size:
        raise ValueError(
            f"cannot tell the vocabulary size of {path}: no token_embd.weight tensor, "
            f"{arch}.vocab_size key or tokenizer.ggml.tokens list"
        )
    return int(size)


def _eos_token_ids(reader: GGUFFile, path: Path) -> list[int]:
    # Llama-3 instruct models end turns with eot (<|eot_id|>) or eom, not only eos.
    ids = [_token_id(reader, kind, path) for kind in ("eos", "eot", "eom")]
    return [i for i in dict.fromkeys(ids) if i is not None]


def _token_id(reader: GGUFFile, kind: str, path: Path) -> int | None:
    """``tokenizer.ggml.<kind>_token_id``: None when absent; ValueError unless an id."""
    key = f"tokenizer.ggml.{kind}_token_id"
    return _checked(metadata_value(reader, key), key, (int,), "a token id", path, _natural)


def _natural(value: int) -> bool:
    return value >= 0


def _checked(
    value: Any,
    key: str,
    kinds: tuple[type, ...],
    what: str,
    path: Path,
    valid: Callable[[Any], bool] | None = None,
) -> Any:
    """``value`` of metadata ``key`` (None when absent), refused unless one of ``kinds`` (a
    bool is no number) and ``valid``: strings and floats were converted (2.9 heads read as
    2), arrays failed with a TypeError naming neither the file nor the key."""
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or (valid is not None and not valid(value))
    ):
        raise ValueError(f"GGUF metadata key {key} in {path} must be {what}, got {value!r:.40}")
    return value


def _rope_scaling(
    reader: GGUFFile,
    tensors: dict[str, Any],
    arch: str,
    head_dim: int,
    rope_theta: float,
    path: Path,
) -> dict[str, Any] | None:
    original_key = f"{arch}.rope.scaling.original_context_length"
    original = metadata_value(reader, original_key)
    rope_freqs = tensors.get("rope_freqs.weight")
    if rope_freqs is not None:
        factors = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1)
        _checked(original, original_key, (int,), "an integer", path)
        context = original or _LLAMA3_ORIGINAL_CONTEXT
        return _llama3_scaling_from_freq_factors(factors, head_dim, rope_theta, context, path)
    kind_key, factor_key = f"{arch}.rope.scaling.type", f"{arch}.rope.scaling.factor"
    kind = metadata_value(reader, kind_key)
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": _checked(kind, kind_key, (str,), "a name", path)}
    factor = _checked(metadata_value(reader, factor_key), factor_key, (int, float), "a number",
                      path)  # fmt: skip
    if factor is not None:
        scaling["factor"] = float(factor)
    if original is not None:
        scaling["original_max_position_embeddings"] = original  # (ModelConfig checks it)
    # Types other than "linear" are refused by ModelConfig with the file named.
    return scaling


def llama3_freq_factors(
    head_dim: int,
    rope_theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> np.ndarray:
    """Per-frequency divisors of Llama-3 rope scaling, as llama.cpp stores them in rope_freqs.

    Returns float64 [head_dim // 2]: 1 for short wavelengths, ``factor`` for long ones and a
    smooth blend in between.
    """
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    ctx = original_max_position_embeddings
    smooth = (ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < ctx / high_freq_factor, 1.0, blended)
    return np.where(wavelen > ctx / low_freq_factor, factor, out)


def _llama3_scaling_from_freq_factors(
    factors: np.ndarray, head_dim: int, rope_theta: float, context: int, path: Path
) -> dict[str, Any]:
    if factors.shape != (head_dim // 2,):
        raise ValueError(
            f"rope_freqs.weight in {path} has shape {list(factors.shape)}, "
            f"expected [{head_dim // 2}] (head_dim / 2)"
        )
    # A config number (8, 32) that went through float32 arithmetic: round the noise off.
    factor = round(float(factors.max()), 3)
    expected = llama3_freq_factors(
        head_dim, rope_theta, factor, _LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR, context
    )
    # The tensor is float32 of the same formula, so agreement is to float32 rounding.
    if not np.allclose(factors, expected, rtol=1e-5, atol=0):
        raise ValueError(
            f"rope_freqs.weight in {path} is not Llama-3 rope scaling with low_freq_factor "
            f"{_LLAMA3_LOW_FREQ_FACTOR}, high_freq_factor {_LLAMA3_HIGH_FREQ_FACTOR} and "
            f"original context {context}; this rope scaling is not supported"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": _LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": _LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": context,
    }
