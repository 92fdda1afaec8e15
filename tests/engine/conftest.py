"""Shared engine fixtures: the real SmolLM2 model and its HF transformers reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.engine.loader import resolve_model_source


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return resolve_model_source("smollm2-135m-instruct").path


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: Path):
    """(model, tokenizer) from HF transformers' own GGUF loader, fp32 on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
    return model, tok


@pytest.fixture(scope="session")
def smollm2_llm():
    from tokenmill import LLM

    return LLM("smollm2-135m-instruct", device="cpu", dtype="float32")
