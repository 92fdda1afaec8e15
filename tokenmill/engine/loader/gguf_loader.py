"""GGUF tensors -> HF-named float32 tensors in HF layout, dequantized one at a time.

    token_embd.weight          -> model.embed_tokens.weight
    output_norm.weight         -> model.norm.weight
    output.weight              -> lm_head.weight            (absent when tied)
    blk.N.attn_q.{weight,bias} -> model.layers.N.self_attn.q_proj.{weight,bias}   (and k, v)
    blk.N.attn_output.weight   -> model.layers.N.self_attn.o_proj.weight
    blk.N.attn_{q,k}_norm      -> model.layers.N.self_attn.{q,k}_norm             (Qwen3)
    blk.N.ffn_{gate,up,down}   -> model.layers.N.mlp.{gate,up,down}_proj
    blk.N.attn_norm            -> model.layers.N.input_layernorm
    blk.N.ffn_norm             -> model.layers.N.post_attention_layernorm
    rope_freqs.weight          -> (not a weight: folded into config.rope_scaling)

GGUF lists dims fastest-first ([in, out]); the reader's arrays are already reversed into
torch order ([out, in]), so no transpose is needed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from tokenmill.engine.loader.gguf_blocks import (
    BLOCK_TYPES,
    NATIVE_TYPES,
    block_rows,
    dequantize_blocks,
)
from tokenmill.engine.loader.gguf_reader import GGUFFile, GGUFTensor
from tokenmill.engine.loader.hf_layout import check_shape, expected_shapes
from tokenmill.engine.model_config import ModelConfig

__all__ = ["hf_tensor_name", "iter_gguf_weights", "linear_weight_types", "unpermute_rope_rows"]

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_NOT_WEIGHTS = frozenset({"rope_freqs.weight"})
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of llama.cpp tensor ``gguf_name``, or None if it has no HF counterpart."""
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    elif m := _GLOBAL_RE.fullmatch(gguf_name):
        part, kind = m.groups()
        if part in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[part]}.{kind}"
    return None


def linear_weight_types(reader: GGUFFile) -> set[str]:
    """The tensor types of the file's linear layers' weights (``*_proj.weight`` in HF names),
    e.g. {"Q4_1"}: what quantization none dequantizes and int4 / int8 run as they are."""
    return {
        t.tensor_type.name
        for t in reader.tensors
        if (name := hf_tensor_name(t.name)) is not None and name.endswith("_proj.weight")
    }


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Llama q or k projection (weight or bias).

    Per head, HF's rotate-half layout keeps the two halves of each rotated pair apart;
    llama.cpp's converter interleaves them for its pairwise RoPE:

        HF:        [x0 x1 ... x(d/2-1) | y0 y1 ... y(d/2-1)]   rotate (x_i, y_i)
        llama.cpp: [x0 y0 x1 y1 ... x(d/2-1) y(d/2-1)]

    Takes and returns ``[n_heads * d, ...]``.
    """
    rest = w.shape[1:]
    half = w.shape[0] // n_heads // 2
    # [n_heads, d/2, 2, ...] -> [n_heads, 2, d/2, ...]
    return w.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(
    reader: GGUFFile, path: Path, config: ModelConfig, arch: str, native: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for each tensor of the GGUF file at ``path``.

    ``arch`` is the file's ``general.architecture``; for "llama" the q/k rows are un-permuted.
    With ``native`` ("int4" or "int8") a linear layer's weight ``x.weight`` comes as its
    blocks instead (gguf_blocks.py): ``x.qweight``, ``x.scales`` and, for int4, ``x.mins``; a
    linear weight of a type the method does not run is then refused. Raises ValueError naming
    the file and tensor for a tensor with no HF counterpart, a quantization type that cannot
    be dequantized, or a shape the config disagrees with.
    """
    shapes = expected_shapes(config)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for tensor in reader.tensors:
        if tensor.name in _NOT_WEIGHTS:
            continue
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ValueError(
                f"tensor {tensor.name} in {path} has no counterpart in the "
                f"{config.architecture} model; this GGUF variant is not supported"
            )
        part = tensor.name.split(".")[-2]
        if native and name.endswith("_proj.weight"):
            yield from _block_tensors(
                tensor, name, path, shapes, native, heads.get(part) if arch == "llama" else None
            )
            continue
        try:
            w = _dequantize(tensor)
        except (NotImplementedError, ValueError) as e:
            raise ValueError(
                f"cannot dequantize tensor {tensor.name} ({tensor.tensor_type.name}) in {path}: {e}"
            ) from e
        check_shape(name, tuple(w.shape), shapes, f"{path} (GGUF tensor {tensor.name})")
        if arch == "llama" and part in heads:
            w = unpermute_rope_rows(w, heads[part])
        # F32 tensors come back as read-only views of the memory map: copy them.
        if type(w) is not np.ndarray or w.dtype != np.float32 or not w.flags.writeable:
            w = np.array(w, dtype=np.float32, order="C", subok=False)
        yield name, torch.from_numpy(w)


def _dequantize(tensor: GGUFTensor) -> np.ndarray:
    """A tensor's float32 values: the block types the kernels run, in gguf_blocks.py's
    vectorized numpy (equal bit for bit); every other type through the gguf package."""
    type_name = tensor.tensor_type.name
    if type_name in BLOCK_TYPES and len(tensor.shape) == 2:
        return dequantize_blocks(tensor.data, type_name, int(tensor.shape[-1]))
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type)


def _block_tensors(
    tensor: GGUFTensor,
    name: str,
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    native: str,
    rope_heads: int | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``name``'s blocks as (qweight, scales[, mins]), q/k rows un-permuted like the
    dequantized weight's."""
    type_name = tensor.tensor_type.name
    if type_name not in NATIVE_TYPES[native]:
        runs = {m: " and ".join(t) for m, t in NATIVE_TYPES.items()}
        others = "; ".join(f"{m}: {t}" for m, t in runs.items() if m != native)
        raise ValueError(
            f"GGUF tensor {tensor.name} in {path} is {type_name}; quantization {native} runs "
            f"{runs[native]} blocks as they are ({others}; quantization none dequantizes "
            "every type)"
        )
    rows = int(tensor.shape[-1])  # GGUF lists dims fastest first: [in, out]
    parts = block_rows(tensor.data, type_name, rows)
    width = parts[0].shape[1] * (2 if native == "int4" else 1)
    check_shape(name, (rows, width), shapes, f"{path} (GGUF tensor {tensor.name})")
    base = name.removesuffix(".weight")
    for leaf, array in zip(("qweight", "scales", "mins")[: len(parts)], parts, strict=True):
        if rope_heads is not None:
            array = np.ascontiguousarray(unpermute_rope_rows(array, rope_heads))
        yield f"{base}.{leaf}", torch.from_numpy(array)
