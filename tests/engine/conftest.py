"""Shared engine fixtures: the real SmolLM2 model and its HF transformers reference."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

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

    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
        ).eval()
    return model, tok


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers parses the file with the ``gguf`` package three times (the tokenizer's
    config, the model's config, the weights: 12 s each for SmolLM2's, one numpy view per
    vocabulary entry) and rebuilds ``gguf``'s name map once per module (13 s). Reusing the
    first reader and each map loads the same model and tokenizer in a third of the time."""
    import gguf

    readers: dict[tuple[str, str], gguf.GGUFReader] = {}
    parse = gguf.GGUFReader

    def reader(path: str | Path, mode: str = "r") -> gguf.GGUFReader:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    name_map = functools.cache(gguf.get_tensor_name_map)
    with (
        mock.patch.object(gguf, "GGUFReader", reader),
        mock.patch.object(gguf, "get_tensor_name_map", name_map),
    ):
        yield


@pytest.fixture(scope="session")
def smollm2_llm():
    from tokenmill import LLM

    return LLM("smollm2-135m-instruct", device="cpu", dtype="float32")
