"""The tiny HF models the loader tests build: architecture and config overrides per case."""

from __future__ import annotations

from typing import Any

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# case -> (tiny arch, config overrides)
TINY_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    # Llama-3.1's real setting: original context 8192 < max positions.
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 16384}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
}
