"""Steps that no decode graph covers run as piecewise CUDA graphs around eager attention, and
give the eager path's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.graph_runs import eager_and_graph_runs
from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.attention.graph_split import GraphSplit
from tokenmill.engine.piecewise_graphs import piecewise_buckets


def test_buckets_cover_every_token_count_with_bounded_padding() -> None:
    buckets = piecewise_buckets(8192)
    assert buckets[0] == 16 and buckets[-1] == 8192
    for n in range(1, 8193):
        t = next(b for b in buckets if b >= n)
        assert n <= 512 or t < 1.5 * n
        assert n <= 1024 or t <= 1.25 * n
    assert piecewise_buckets(100) == [16, 32, 64, 100]
    assert piecewise_buckets(3000)[-3:] == [2048, 2560, 3000]


class _Through(GraphSplit):
    """A split that runs the real attention in place: the model's seam, without graphs."""

    def __init__(self, backend: Any, meta: Any, seen: list[int]) -> None:
        self.backend, self.meta, self.seen = backend, meta, seen

    def split(self, q, k, v, kv_cache, scale):  # noqa: ANN001, ANN201
        self.seen.append(q.shape[0])
        return self.backend.forward(q, k, v, kv_cache, self.meta, scale)


def test_each_layer_splits_once_at_its_attention(tmp_path: Path) -> None:
    """With every step's metadata wrapped in a split, each layer hands its q/k/v to the split
    exactly once a step, and the tokens are the plain forward's."""
    path = save_tiny_model("llama", tmp_path / "m")
    prompts = [[5, 9, 17, 33], [7, 8, 9, 10, 11, 12], [40, 41]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = LLM(str(path), device="cpu", dtype="float32")
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(path), device="cpu", dtype="float32")
    runner = llm.engine.runner
    seen: list[int] = []
    build = runner.backend.build
    runner.backend.build = lambda common: _Through(runner.backend, build(common), seen)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    layers = len(runner.model.model.layers)
    assert seen and len(seen) % layers == 0
    steps = [seen[i : i + layers] for i in range(0, len(seen), layers)]
    assert all(len(set(s)) == 1 for s in steps)  # one token count a step, every layer


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_prefill_and_mixed_steps_in_pieces_match_eager(tmp_path: Path, dtype: str) -> None:
    """Prompts of many lengths arriving while others decode (max_num_seqs 4 of 10 requests):
    prefill and mixed steps replay the pieces, with the eager path's tokens."""
    path = save_tiny_model("llama", tmp_path / "m", max_position_embeddings=1024)
    g = torch.Generator().manual_seed(0)
    lens = (3, 17, 40, 9, 64, 200, 1, 33, 130, 77)
    prompts = [torch.randint(5, 280, (n,), generator=g).tolist() for n in lens]
    params = [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
        for m in (30, 12, 30, 5, 30, 7, 20, 9, 25, 3)
    ]
    eager, graphs, profile = eager_and_graph_runs(path, prompts, params, dtype, 4)
    other = profile["prefill_or_mixed"]
    assert other["graph_steps"] == other["steps"] > 1  # every one replayed the pieces
    assert graphs == eager
