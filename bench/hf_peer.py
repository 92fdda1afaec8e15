"""Helpers shared by the benchmarks that run HF transformers `generate` as the peer."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf_model(model_path: Path, device: str) -> torch.nn.Module:
    """The HF model of a .gguf file (dequantized by transformers) or an HF directory, in eval
    mode on ``device`` (fp32 on CPU, bf16 elsewhere)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    where = {"gguf_file": model_path.name} if model_path.is_file() else {}
    folder = model_path.parent if model_path.is_file() else model_path
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **where).to(device).eval()


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask), both [B, longest], prompts right-aligned after ``pad``."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask
