"""The sampling defaults a model's creator recommends, read as vLLM's ``LLM`` reads them.

vLLM's ``LLM(generation_config="auto")`` (its default) takes ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``) from
the model's ``generation_config.json`` for ``llm.get_default_sampling_params()`` and for a
``generate`` / ``chat`` call given no SamplingParams; a SamplingParams the caller builds
keeps its own defaults. Qwen3's file, for one, asks for temperature 0.6, top_p 0.95 and
top_k 20: without reading it the same script sampled at temperature 1 with no top-k.

    generation_config="auto"     the model folder's generation_config.json (a GGUF file or
                                 a folder without one: none)
    generation_config="vllm"     none: SamplingParams' own defaults
    generation_config=<folder>   that folder's generation_config.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.engine.sampling_params import SamplingParams

__all__ = ["sampling_defaults"]

FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM's list)
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# transformers' GenerationConfig defaults: vLLM reads the file through ``to_diff_dict``,
# which leaves these out, so a file's top_k of 50 is not applied there either.
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def sampling_defaults(model_path: str | Path, generation_config: Any = "auto") -> dict[str, Any]:
    """The SamplingParams fields that ``generation_config`` ("auto", "vllm" or a folder;
    see the module docstring) sets for the model at ``model_path`` (checked: a
    ``SamplingParams(**defaults)`` of them does not fail).

    Raises ValueError naming ``generation_config`` for another value or a folder without
    the file, and naming the file when it is not a JSON object or a value is out of range.
    """
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        folder = Path(model_path)
        if not (folder.is_dir() and (folder / FILE).is_file()):
            return {}
    elif isinstance(generation_config, str | Path) and Path(generation_config).is_dir():
        folder = Path(generation_config).expanduser()
        if not (folder / FILE).is_file():
            raise ValueError(
                f"generation_config={str(generation_config)!r}: the folder holds no {FILE}; "
                'pass a folder that does, "auto" (the model\'s) or "vllm" (no model defaults)'
            )
    else:
        raise ValueError(
            f"generation_config must be 'auto' (the model's {FILE}), 'vllm' (no model "
            f"defaults) or a folder holding a {FILE}; got {generation_config!r}"
        )
    return _read(folder / FILE)


def _read(path: Path) -> dict[str, Any]:
    try:
        cfg: Any = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or delete it") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    defaults = {
        field: cfg[key]
        for key, field in _KEYS.items()
        if cfg.get(key) is not None and not _is_hf_default(key, cfg[key])
    }
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (pass generation_config='vllm' to ignore it)") from None
    return defaults


def _is_hf_default(key: str, value: Any) -> bool:
    default = _HF_DEFAULTS.get(key)
    return default is not None and not isinstance(value, bool) and value == default
