from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a byte-level tokenizer and a chat template (as the job
    tests' own)."""
    return save_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=1024
    )
