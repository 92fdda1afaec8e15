"""LengthHistogram: token counts of every row in a fixed number of bins, exact and bounded.

    bin_width w:   [0, w) [w, 2w) ... [(n-1)w, nw)          n = num_bins bins, counts exact
    a value >= nw: merge neighbouring bins pairwise, w = 2w, until it fits

The range is not known in advance (prompts of 30 tokens or of 30,000), so the bins start one
token wide and double when a longer row arrives. Each row is counted once, in the bin that
holds its exact length at the current width: merging keeps every count exact, only coarser.
Memory is ``num_bins`` integers whatever the number of rows.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LengthHistogram"]


class LengthHistogram:
    """Counts of non-negative lengths in ``num_bins`` bins of a power-of-two width."""

    def __init__(self, num_bins: int = 64) -> None:
        if num_bins < 2 or num_bins % 2:
            raise ValueError(f"num_bins must be an even number >= 2, got {num_bins}")
        self.counts = [0] * num_bins
        self.bin_width = 1
        self.count = 0
        self.total = 0
        self.min: int | None = None
        self.max: int | None = None

    def add(self, length: int) -> None:
        """Count one row of ``length`` tokens. Raises ValueError for a negative length."""
        if length < 0:
            raise ValueError(f"a length must be >= 0, got {length}")
        while length >= len(self.counts) * self.bin_width:
            self._coarsen()
        self.counts[length // self.bin_width] += 1
        self.count += 1
        self.total += length
        self.min = length if self.min is None else min(self.min, length)
        self.max = length if self.max is None else max(self.max, length)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def bins(self) -> list[tuple[int, int, int]]:
        """(first length, last length + 1, rows) of each bin from the first non-empty one to
        the last; empty without rows."""
        used = [i for i, c in enumerate(self.counts) if c]
        if not used:
            return []
        w = self.bin_width
        return [(i * w, (i + 1) * w, self.counts[i]) for i in range(used[0], used[-1] + 1)]

    def to_dict(self) -> dict[str, Any]:
        """For report.json: bin ``i`` of ``counts`` holds the rows of lengths in
        [start + i * bin_width, start + (i + 1) * bin_width)."""
        bins = self.bins()
        return {
            "rows": self.count,
            "tokens": self.total,
            "min": self.min,
            "max": self.max,
            "mean": round(self.mean, 2),
            "start": bins[0][0] if bins else 0,
            "bin_width": self.bin_width,
            "counts": [c for _, _, c in bins],
        }

    def _coarsen(self) -> None:
        n = len(self.counts)
        merged = [self.counts[i] + self.counts[i + 1] for i in range(0, n, 2)]
        self.counts = merged + [0] * (n - len(merged))
        self.bin_width *= 2
