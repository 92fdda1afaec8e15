"""ParallelConfig: a rank in a tensor-parallel group, checked when built."""

from __future__ import annotations

import pytest

from tokenmill.engine.parallel import ParallelConfig


def test_default_is_rank_0_of_1() -> None:
    assert ParallelConfig() == ParallelConfig(tp_rank=0, tp_size=1)
    assert ParallelConfig().per_rank(7, "x") == 7


@pytest.mark.parametrize(
    ("rank", "size", "message"),
    [
        (0, 0, "tp_size must be at least 1, got 0"),
        (2, 2, r"tp_rank must be in \[0, tp_size=2\), got 2"),
        (-1, 2, r"tp_rank must be in \[0, tp_size=2\), got -1"),
    ],
)
def test_bad_rank_or_size_names_the_key(rank: int, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(tp_rank=rank, tp_size=size)


def test_per_rank_splits_evenly_or_names_what_does_not() -> None:
    parallel = ParallelConfig(tp_rank=1, tp_size=4)
    assert parallel.per_rank(32, "num_attention_heads") == 8
    with pytest.raises(
        ValueError, match="num_key_value_heads=2 does not split evenly over tp_size=4"
    ):
        parallel.per_rank(2, "num_key_value_heads")
