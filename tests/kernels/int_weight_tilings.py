"""The tilings the W4A16 and W8A16 kernel tests run (int_weight_tiles.py): split-K, several
whole groups or part of one group per tile, tensor-core dots and CUDA-core sums; each with
the group size it is tried at, on a [3, 512] x [512, 40] product."""

from __future__ import annotations

from tokenmill.kernels.int_weight_tiles import IntGemmTiles

__all__ = ["TILINGS"]

TILINGS: list[tuple[IntGemmTiles, int]] = [
    (IntGemmTiles(16, 32, 256, split_k=2), 32),  # 8 groups a tile, 2 K runs
    (IntGemmTiles(16, 32, 128, split_k=4), 32),  # 4 K runs
    (IntGemmTiles(32, 16, 64, split_k=2), 128),  # a tile inside one group
    (IntGemmTiles(1, 16, 128, split_k=2, mma=False), 32),  # CUDA-core sums, a row each
    (IntGemmTiles(4, 32, 64, mma=False), 128),  # CUDA-core sums, part of a group
    (IntGemmTiles(16, 16, 256), 128),  # 2 groups a tile
    (IntGemmTiles(16, 16, 1024, split_k=8), 64),  # fitted down to K's 512
]
