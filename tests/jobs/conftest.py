from __future__ import annotations

from pathlib import Path

import pytest

from tests.jobs.job_helpers import TINY_ENGINE
from tests.tiny_models import save_tiny_model
from tokenmill import LLM


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a byte-level tokenizer and a chat template."""
    return save_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    """The Python API on the tiny model, the reference of a module's job outputs."""
    return LLM(str(tiny_model), **TINY_ENGINE)
