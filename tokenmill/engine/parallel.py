"""Where this process sits in a tensor-parallel group: its rank and the group's size.

The model's layers take a ParallelConfig and hold their rank's shard of each weight:

    column-parallel (qkv_proj, gate_up_proj): rank r holds rows    [r*n/tp, (r+1)*n/tp) of W
    row-parallel    (o_proj, down_proj):      rank r holds columns [r*k/tp, (r+1)*k/tp) of W

The engine runs one rank of one (``tp_size=1``, the default) today; the model then holds every
full matrix and no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelConfig"]


@dataclass(frozen=True)
class ParallelConfig:
    """This process's tensor-parallel rank ``tp_rank`` in a group of ``tp_size`` processes.

    Raises ValueError naming the key when ``tp_size < 1`` or ``tp_rank`` is not in
    ``[0, tp_size)``.
    """

    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be at least 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")

    def per_rank(self, total: int, what: str) -> int:
        """``total`` split evenly over the ranks (heads, rows or columns of one rank).

        ``what`` names the quantity (a config key where there is one) for the error: raises
        ValueError if ``total`` does not divide by ``tp_size``.
        """
        if total % self.tp_size:
            raise ValueError(
                f"{what}={total} does not split evenly over tp_size={self.tp_size} ranks; "
                f"use a tp_size that divides {total}"
            )
        return total // self.tp_size
