"""The attention backend owns its KV-cache layout: the runner allocates what the backend asks
for, and the engine sizes its block count from those bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import save_tiny_model
from tokenmill.engine.attention.backend import get_attention_backend
from tokenmill.engine.attention.metadata import CommonAttentionMetadata
from tokenmill.engine.attention.torch_backend import TorchAttentionBackend
from tokenmill.engine.engine_config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.model_runner import kv_bytes_per_block, kv_cache_shape
from tokenmill.engine.parallel import ParallelConfig


class PaddedLayoutBackend(TorchAttentionBackend):
    """The torch backend with a spare block per layer: a layout other than the default."""

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (2, num_blocks + 1, block_size, num_kv_heads, head_dim)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("kv") / "m")


def test_runner_allocates_the_backends_layout(model_path: Path) -> None:
    config = EngineConfig(model=str(model_path), device="cpu", dtype="float32", block_size=4,
                          kv_cache_memory=1 << 20)  # fmt: skip
    engine = LLMEngine(config)
    runner, mc = engine.runner, engine.model_config
    shape = kv_cache_shape(mc, runner.backend, runner.num_blocks, 4)
    assert tuple(runner.kv_cache.shape) == shape
    assert shape == (mc.num_hidden_layers, 2, runner.num_blocks, 4, mc.num_key_value_heads,
                     mc.head_dim)  # fmt: skip
    per_block = kv_bytes_per_block(mc, runner.backend, 4, runner.dtype)
    assert per_block * runner.num_blocks == runner.kv_cache.nbytes
    assert runner.num_blocks == (1 << 20) // per_block


def test_bytes_per_block_follow_the_layout_and_the_rank(model_path: Path) -> None:
    mc = LLMEngine(
        EngineConfig(model=str(model_path), device="cpu", dtype="float32", kv_cache_memory=1 << 20)
    ).model_config
    plain = get_attention_backend("torch", mc.num_key_value_heads)
    padded = PaddedLayoutBackend()
    elem = 4  # float32
    assert kv_bytes_per_block(mc, plain, 8, torch.float32) == (
        mc.num_hidden_layers * 2 * 8 * mc.num_key_value_heads * mc.head_dim * elem
    )
    # One block's worth: the padded layout's spare block counts too.
    assert kv_bytes_per_block(mc, padded, 8, torch.float32) == 2 * kv_bytes_per_block(
        mc, plain, 8, torch.float32
    )
    if mc.num_key_value_heads % 2 == 0:
        half = kv_bytes_per_block(mc, plain, 8, torch.float32, ParallelConfig(0, 2))
        assert 2 * half == kv_bytes_per_block(mc, plain, 8, torch.float32)


def test_capture_metadata_serves_the_longest_sequence() -> None:
    """The default capture hook builds as if every sequence were max_model_len long."""
    seen = []

    class Recording(TorchAttentionBackend):
        def build(self, common):
            seen.append(common.seq_lens_host.copy())
            return super().build(common)

    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(3, dtype=torch.int32),
        seq_lens=torch.zeros(2, dtype=torch.int32),
        block_tables=torch.zeros((2, 4), dtype=torch.int32),
        slot_mapping=torch.full((2,), -1, dtype=torch.int64),
        query_lens_host=np.ones(2, dtype=np.int64),
        seq_lens_host=np.zeros(2, dtype=np.int64),
        block_size=4,
        num_decodes=2,
    )
    Recording().capture_metadata(common, 16)
    assert seen[0].tolist() == [16, 16]
