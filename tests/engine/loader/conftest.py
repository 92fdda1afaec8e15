"""Loader fixtures: tiny HF directories of each architecture, and tiny GGUF files made from them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.engine.loader.cases import TINY_CASES
from tests.engine.loader.tiny_gguf import write_tiny_gguf
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """case name (a TINY_CASES key) -> a saved tiny HF directory, built once per session."""
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            arch, overrides = TINY_CASES[case]
            built[case] = save_tiny_model(arch, tmp_path_factory.mktemp(case), **overrides)
        return built[case]

    return get


@pytest.fixture(scope="session")
def tiny_gguf(
    tiny_hf_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """case name (a TINY_CASES key) -> a tiny F32 GGUF file converted from that HF directory."""
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            out = tmp_path_factory.mktemp(f"{case}-gguf") / f"{case}.F32.gguf"
            built[case] = write_tiny_gguf(tiny_hf_dir(case), out)
        return built[case]

    return get
