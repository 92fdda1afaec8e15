"""Chat token ids, on the tiny test tokenizer (its ChatML-like template)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_tokenizer
from tokenmill.engine.loader.tokenizer import load_hf_tokenizer
from tokenmill.engine.prompts import encode_chat


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    return path


def test_a_conversation_that_is_not_unicode_is_named(tiny_dir: Path) -> None:
    """A lone surrogate (JSON's "\\ud800") reached the tokenizer, whose TypeError ("TextEncodeInput
    must be Union[...]") named neither cause nor place: LLM.encode_chat's, and each Ray Data
    row's error."""
    tokenizer = load_hf_tokenizer(tiny_dir)
    messages = [{"role": "user", "content": "ok \ud800"}]
    with pytest.raises(ValueError, match=r"not valid Unicode \(a lone surrogate, '\\ud800', at"):
        encode_chat(tokenizer, messages)
