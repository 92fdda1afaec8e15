"""Runs: arrays that hold several entries a row, each row's one after another (a step's
sampled tokens and drafts, a constrained row's masks, a request's prompt tokens), and where
a row's entries sit in them. Numpy only: each helper replaces a per-row Python loop.

    counts [2, 0, 3]   entries  a a | c c c    within_runs  0 1 | 0 1 2
                                               run_entries(counts, [2])  2 3 4
"""

from __future__ import annotations

import numpy as np

__all__ = ["run_entries", "within_runs"]


def within_runs(counts: np.ndarray) -> np.ndarray:
    """[sum(counts)] each entry's place within its run: 0 .. counts[i] - 1 for run i."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def run_entries(counts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Where the entries of runs ``rows`` (in that order) are among every run's ``counts``
    entries one run after another."""
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    return np.repeat(starts[rows], counts[rows]) + within_runs(counts[rows])
