"""Decode steps replayed from CUDA graphs give the eager path's tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine.graph_runs import eager_and_graph_runs
from tests.tiny_models import save_tiny_model
from tokenmill import SamplingParams
from tokenmill.engine.cuda_graphs import _padded_rows, graph_buckets


def test_graph_buckets_cover_every_batch_size() -> None:
    buckets = graph_buckets(100)
    assert buckets[:4] == [1, 2, 4, 8] and buckets[-1] == 100
    assert all(any(b >= n for b in buckets) for n in range(1, 101))
    assert graph_buckets(1) == [1]


def test_drafted_rows_are_left_padded_to_the_graph_query_length() -> None:
    # Rows of 3, 1 and 2 tokens in a graph of 3 tokens a row: each row's tokens end its rows.
    dest = _padded_rows(np.array([3, 1, 2], dtype=np.int32), 3)
    assert dest.tolist() == [0, 1, 2, 5, 7, 8]
    assert _padded_rows(np.ones(4, dtype=np.int32), 1) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_matches_eager(tmp_path: Path, dtype: str) -> None:
    path = save_tiny_model("llama", tmp_path / "m", max_position_embeddings=1024)
    g = torch.Generator().manual_seed(0)
    # 5 and then 3 running requests: batches padded up to the 8 and 4 buckets.
    prompts = [torch.randint(5, 280, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 64)]
    lengths = [30, 12, 30, 5, 30]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    eager, graphs, profile = eager_and_graph_runs(path, prompts, params, dtype, 16)
    assert profile["decode"]["graph_steps"] == profile["decode"]["steps"] > 0
    assert graphs == eager
