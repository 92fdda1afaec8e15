"""The engine seed on CPU: torch's CPU generator (mt19937) keeps a seed's low 32 bits, so
seeds that differ above them sampled alike until the 64 bits were mixed in first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.model_loader import init_random_weights

# Pairs with the same low 32 bits: one generator state each before the fix.
SAME_LOW_BITS = [(0, 2**32), (-1, 2**63 - 1)]
PARAMS = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("seeds") / "m")


def _samples(model: Path, seed: int) -> list[list[int]]:
    llm = LLM(str(model), device="cpu", dtype="float32", seed=seed)
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize(("seed", "other"), SAME_LOW_BITS)
def test_engine_seeds_apart_above_32_bits_sample_apart_on_cpu(
    model: Path, seed: int, other: int
) -> None:
    """An audit: LLM(seed=0) and LLM(seed=2**32) drew the same tokens for unseeded
    requests on CPU, as did -1 and 2**63 - 1; the same seed still draws the same."""
    first = _samples(model, seed)
    assert _samples(model, seed) == first
    assert _samples(model, other) != first


@pytest.mark.parametrize(("seed", "other"), SAME_LOW_BITS)
def test_random_weights_of_seeds_apart_above_32_bits_differ_on_cpu(seed: int, other: int) -> None:
    """load_format random took the engine seed as it is: on CPU, 0 and 2**32 made the same
    weights."""
    a, b, again = (torch.nn.Linear(8, 8, bias=False) for _ in range(3))
    init_random_weights(a, seed)
    init_random_weights(b, other)
    init_random_weights(again, seed)
    assert torch.equal(a.weight, again.weight)
    assert not torch.equal(a.weight, b.weight)
