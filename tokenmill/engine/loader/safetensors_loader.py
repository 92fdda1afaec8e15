"""HF model directories: ``config.json`` plus safetensors weights, streamed one tensor at a time.

    model_dir/
      config.json                       -> ModelConfig.from_hf_dict
      model.safetensors                 one file, or
      model.safetensors.index.json      {"weight_map": {tensor name: shard file}} + the shards, or
      *.safetensors                     any other set of files, read in name order

Only safetensors are read: pickle checkpoints (``pytorch_model.bin``, ``*.pt``) can run code
when loaded, so they are refused by ``resolve_model_source`` before we get here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tokenmill.engine.loader.awq_gptq import repack_int4_layers
from tokenmill.engine.loader.checkpoint_quant import (
    SUPPORTED,
    Int4Checkpoint,
    checkpoint_quantization,
)
from tokenmill.engine.loader.hf_layout import check_shape, expected_shapes
from tokenmill.engine.model_config import ModelConfig

__all__ = ["load_hf_config", "safetensors_files", "iter_safetensors_weights"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Buffers some older checkpoints saved alongside the weights; the engine computes them itself.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
# Integer tensors of a GPTQ / AWQ layer: its packed codes and zeros, and GPTQ's input groups.
_PACKED_INT_SUFFIXES = (".qweight", ".qzeros", ".g_idx")


def load_hf_config(model_dir: Path) -> ModelConfig:
    """Parse ``model_dir/config.json``. Raises FileNotFoundError or ValueError naming the file."""
    config_path = model_dir / "config.json"
    try:
        cfg: Any = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{config_path} does not exist; an HF model directory needs config.json next to "
            "its *.safetensors files"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path} is not valid JSON ({e}); fix or re-download it") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(cfg).__name__}")
    quantization = checkpoint_quantization(cfg, config_path)
    config = ModelConfig.from_hf_dict(cfg, source=str(config_path))
    # As HF generate: generation_config.json's stop ids when it gives some, not config.json's
    # as well (the tokenizer's EOS is added by the engine, as vLLM adds it).
    eos = _generation_eos_ids(model_dir) or config.eos_token_ids
    return replace(config, quantization=quantization, eos_token_ids=eos)


def _generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """``eos_token_id`` of ``model_dir/generation_config.json`` (an id or a list), if the
    file is there: the ids HF ``generate`` stops at. Instruct checkpoints often list their
    end-of-turn token only there (Llama-3-Instruct's <|eot_id|>), so without them rows ran
    on to max_tokens. Raises ValueError naming the file when it is not valid JSON."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        cfg: Any = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or delete it") from e
    eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of ``model_dir``, in load order.

    Raises FileNotFoundError naming the directory (no weights) or the index and the shard it
    lists that is missing; ValueError if the index is not valid JSON or names a shard
    outside the directory.
    """
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{index_path} is not a valid safetensors index (need a 'weight_map' object): {e}"
            ) from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ValueError(
                f"{index_path} is not a valid safetensors index: its 'weight_map' must map "
                "tensor names to shard file names"
            )
        names = list(dict.fromkeys(weight_map.values()))
        for name in names:
            # A bare file name (the file itself may link elsewhere, as the HF hub cache's
            # snapshots link to its blobs)
            if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
                raise ValueError(
                    f"{index_path} lists shard {name!r}, which is not a file name in "
                    f"{model_dir}: an index names its shards in the model's own directory"
                )
        files = [model_dir / name for name in names]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(
                    f"{index_path} lists shard {file.name}, which is missing from {model_dir}; "
                    "re-download the checkpoint"
                )
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {model_dir}")
    return files


def stored_tensor_names(model_dir: Path) -> list[str]:
    """The names of the tensors ``model_dir``'s weight files hold, read from their headers.
    Raises ValueError naming a file that is not readable safetensors."""
    names: list[str] = []
    for file in safetensors_files(model_dir):
        with _opened(file) as f:
            names.extend(f.keys())
    return names


def _opened(file: Path) -> Any:
    """``file`` opened with safetensors (a context manager). Raises PermissionError or
    ValueError naming the file when it cannot be read, or is not safetensors."""
    if not os.access(file, os.R_OK):  # safetensors says "No such file" for this too
        raise PermissionError(f"{file} cannot be read: permission denied")
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"{file} is not a readable safetensors file ({e}); it may be truncated or "
            "corrupt: re-download it"
        ) from e


def iter_safetensors_weights(
    model_dir: Path, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of every weight file, one at a time.

    Tensors keep their stored float dtype and HF layout; an FP8 checkpoint's e4m3 weights and
    their ``weight_scale`` come as they are, its ``input_scale`` not at all (activations are
    scaled per token). A GPTQ / AWQ checkpoint's linear layers come repacked for the W4A16
    layer, as ``<layer>.qweight``, ``.scales`` and ``.mins`` (awq_gptq.py). Raises ValueError
    naming the file for a corrupt or truncated file, a tensor stored in two files, a
    non-float (quantized) tensor the config declares no format for, an e4m3 tensor outside
    an FP8 checkpoint, or a shape the config disagrees with.
    """
    shapes = expected_shapes(config)
    int4 = Int4Checkpoint.from_name(config.quantization)
    tensors = _read_tensors(model_dir, config, shapes, packed_ints=int4 is not None)
    if int4 is not None:
        yield from repack_int4_layers(tensors, int4, shapes)
    else:
        yield from ((name, tensor) for name, tensor, _ in tensors)


def _read_tensors(
    model_dir: Path,
    config: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    packed_ints: bool,
) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """``(hf_name, tensor, file)`` of every tensor, checked as ``iter_safetensors_weights``
    says; with ``packed_ints`` the int32 words of GPTQ / AWQ layers pass too."""
    fp8 = config.quantization == "fp8"
    seen: dict[str, Path] = {}  # tensor name -> the file it came from
    for file in safetensors_files(model_dir):
        with _opened(file) as f:
            for name in f.keys():
                if name.endswith(_SKIPPED_SUFFIXES) or (fp8 and name.endswith(".input_scale")):
                    continue
                if name in seen:
                    raise ValueError(
                        f"tensor {name} is stored in both {seen[name]} and {file}: which one "
                        "the model should use is ambiguous; re-download the checkpoint"
                    )
                seen[name] = file
                try:
                    tensor = f.get_tensor(name)
                except (SafetensorError, OSError, RuntimeError) as e:
                    raise ValueError(f"cannot read tensor {name} from {file} ({e})") from e
                packed = packed_ints and name.endswith(_PACKED_INT_SUFFIXES)
                if fp8 and _is_linear_weight(name) and tensor.dtype != torch.float8_e4m3fn:
                    raise ValueError(
                        f"tensor {name} in {file} has dtype {tensor.dtype}; an FP8 checkpoint's "
                        "linear layers are stored as float8_e4m3fn with a weight_scale (e5m2, "
                        f"or a layer left in full precision, would run wrong); supported are "
                        f"{SUPPORTED}"
                    )
                # A 1-byte float (any FP8 kind, e4m3fnuz too) is a quantized value: only an
                # FP8 checkpoint's linear layers hold them, with their weight_scale (one in
                # the embeddings or the LM head would run unscaled).
                one_byte = tensor.is_floating_point() and tensor.element_size() == 1
                if one_byte and fp8 and not _is_linear_weight(name):
                    raise ValueError(
                        f"tensor {name} in {file} has dtype {tensor.dtype}; an FP8 "
                        "checkpoint stores only its layers' linear weights as FP8, each with a "
                        "weight_scale (embeddings and the LM head in bf16, fp16 or fp32: "
                        f"this one would run unscaled); supported are {SUPPORTED}"
                    )
                if not (tensor.is_floating_point() or packed) or (one_byte and not fp8):
                    raise ValueError(
                        f"tensor {name} in {file} has dtype {tensor.dtype}, and config.json "
                        f"declares no quantization that stores it; supported are {SUPPORTED}"
                    )
                check_shape(name, tuple(tensor.shape), shapes, str(file))
                yield name, tensor, file


def _is_linear_weight(name: str) -> bool:
    """A decoder layer's attention or MLP projection weight (``...*_proj.weight``)."""
    return name.endswith("_proj.weight") and ".layers." in name
