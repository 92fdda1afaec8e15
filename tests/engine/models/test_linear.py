"""Tensor-parallel linear layers on CPU: the shards that tp_size=2 ranks load from whole
checkpoint tensors reproduce the unsplit ``F.linear`` (column outputs concatenated per part,
row outputs summed), with GQA's unequal q/k/v parts; tp_size=1 holds the full matrix."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.nn.functional as F

from tokenmill.engine.models.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from tokenmill.engine.parallel import ParallelConfig

TP = 2
HIDDEN = 32
# GQA: 4 query heads, 2 KV heads of 8 -> q 32 rows, k and v 16 each
QKV_SIZES = (32, 16, 16)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rank(rank: int) -> ParallelConfig:
    return ParallelConfig(tp_rank=rank, tp_size=TP)


def _load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard_id: int | None = None):
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("bias", [False, True])
def test_column_shards_concatenate_to_the_full_output(bias: bool) -> None:
    w, b, x = _rand(24, HIDDEN, seed=0), _rand(24, seed=1), _rand(5, HIDDEN, seed=2)
    outs = []
    for rank in range(TP):
        layer = ColumnParallelLinear(HIDDEN, 24, bias, parallel=_rank(rank))
        assert layer.weight.shape == (24 // TP, HIDDEN)
        _load(layer, "weight", w)
        if bias:
            _load(layer, "bias", b)
        outs.append(layer(x))  # [5, 12]: this rank's output features
    torch.testing.assert_close(torch.cat(outs, dim=-1), F.linear(x, w, b if bias else None))


def test_merged_qkv_shards_reassemble_each_gqa_part() -> None:
    parts = [_rand(n, HIDDEN, seed=i) for i, n in enumerate(QKV_SIZES)]  # q, k, v
    biases = [_rand(n, seed=10 + i) for i, n in enumerate(QKV_SIZES)]
    x = _rand(7, HIDDEN, seed=20)
    per_rank = [n // TP for n in QKV_SIZES]
    outs = []
    for rank in range(TP):
        layer = MergedColumnParallelLinear(HIDDEN, QKV_SIZES, bias=True, parallel=_rank(rank))
        assert layer.weight.shape == (sum(per_rank), HIDDEN)
        for shard_id, (w, b) in enumerate(zip(parts, biases, strict=True)):
            _load(layer, "weight", w, shard_id)
            _load(layer, "bias", b, shard_id)
        outs.append(layer(x).split(per_rank, dim=-1))  # this rank's (q, k, v) rows
    for i, (w, b) in enumerate(zip(parts, biases, strict=True)):
        got = torch.cat([out[i] for out in outs], dim=-1)
        torch.testing.assert_close(got, F.linear(x, w, b), msg=f"part {i}")


@pytest.mark.parametrize("bias", [False, True])
def test_row_partial_outputs_sum_to_the_full_output(bias: bool) -> None:
    w, b, x = _rand(HIDDEN, 24, seed=0), _rand(HIDDEN, seed=1), _rand(5, 24, seed=2)
    partials = []
    for rank, x_shard in enumerate(x.chunk(TP, dim=-1)):  # each rank sees its 12 inputs
        layer = RowParallelLinear(24, HIDDEN, bias, reduce_results=False, parallel=_rank(rank))
        assert layer.weight.shape == (HIDDEN, 24 // TP)
        _load(layer, "weight", w)
        if bias:
            _load(layer, "bias", b)
            assert torch.equal(layer.bias, b)  # held whole; added on rank 0 only
        partials.append(layer(x_shard))
    torch.testing.assert_close(sum(partials), F.linear(x, w, b if bias else None))


def test_one_rank_holds_the_full_matrices() -> None:
    parts = [_rand(n, HIDDEN, seed=i) for i, n in enumerate(QKV_SIZES)]
    qkv = MergedColumnParallelLinear(HIDDEN, QKV_SIZES)
    for shard_id, w in enumerate(parts):
        _load(qkv, "weight", w, shard_id)
    assert torch.equal(qkv.weight, torch.cat(parts))
    o = RowParallelLinear(HIDDEN, HIDDEN)
    w = _rand(HIDDEN, HIDDEN, seed=5)
    _load(o, "weight", w)
    assert torch.equal(o.weight, w)
    assert (qkv.tp_rank, qkv.tp_size, o.tp_rank, o.tp_size) == (0, 1, 0, 1)


def test_loaders_check_the_unsplit_shape() -> None:
    qkv = MergedColumnParallelLinear(HIDDEN, QKV_SIZES, parallel=_rank(1))
    with pytest.raises(ValueError, match=r"has shape \(8, 32\), expected \(16, 32\)"):
        _load(qkv, "weight", torch.zeros(8, HIDDEN), shard_id=1)  # k: a shard, not all of it
    with pytest.raises(ValueError, match="loaded whole, but its parameter merges 3 parts"):
        _load(qkv, "weight", torch.zeros(64, HIDDEN))
    o = RowParallelLinear(HIDDEN, 16, parallel=_rank(0))
    with pytest.raises(ValueError, match=r"has shape \(16, 16\), expected \(16, 32\)"):
        _load(o, "weight", torch.zeros(16, 16))


def test_uneven_split_is_refused() -> None:
    with pytest.raises(ValueError, match="output size=6 does not split evenly over tp_size=4"):
        ColumnParallelLinear(8, 6, parallel=ParallelConfig(tp_rank=0, tp_size=4))
    with pytest.raises(ValueError, match="input size=6 does not split evenly over tp_size=4"):
        RowParallelLinear(6, 8, parallel=ParallelConfig(tp_rank=0, tp_size=4))


def _row_parallel_rank(rank: int, port: int, w: torch.Tensor, b: torch.Tensor, x: torch.Tensor):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        layer = RowParallelLinear(w.shape[1], w.shape[0], bias=True, parallel=_rank(rank))
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        y = layer(x.chunk(TP, dim=-1)[rank])
        torch.testing.assert_close(y, F.linear(x, w, b))  # every rank holds the sum
    finally:
        dist.destroy_process_group()


def test_row_parallel_all_reduces_over_the_process_group() -> None:
    """Two gloo ranks on CPU: forward's all-reduce gives each the full output, bias once."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    w, b, x = _rand(HIDDEN, 24, seed=0), _rand(HIDDEN, seed=1), _rand(5, 24, seed=2)
    mp.spawn(_row_parallel_rank, args=(port, w, b, x), nprocs=TP, join=True)
