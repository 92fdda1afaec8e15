"""Hashes of the m-grams that end at a token, for every size m at once (numpy, no loops over
tokens). The n-gram proposer's per-row index and the job-wide output corpus both key their
tables with it; a hit is always checked against the tokens, since hashes collide."""

from __future__ import annotations

import numpy as np

__all__ = ["GramHasher"]

_MULT = np.uint64(0x100000001B3)  # FNV-1a's 64-bit prime: mixes one token per round
_SEED = np.uint64(0xCBF29CE484222325)
_FINAL = np.uint64(0xFF51AFD7ED558CCD)  # MurmurHash3's 64-bit finalizer constant


class GramHasher:
    """Table entries (``bits`` wide) of the m-grams for m = max_n .. min_n (longest first)."""

    def __init__(self, min_n: int, max_n: int, bits: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.bits = min_n, max_n, bits
        self.sizes = np.arange(max_n, min_n - 1, -1, dtype=np.int64)  # [S], longest first
        self.back = np.arange(max_n - 1, -1, -1)  # window column c is ``back[c]`` tokens back
        self._salt = self.sizes.astype(np.uint64)  # the size, mixed in by the finalizer

    def __call__(self, windows: np.ndarray) -> np.ndarray:
        """[P, S] entries of the m-grams ending at each window's last token; ``windows``
        [P, max_n] holds the tokens oldest .. newest. The newest token is mixed first, one
        round a token, so the shorter grams' hashes fall out on the way to the longest."""
        g = windows.astype(np.uint64)
        h = np.full(len(windows), _SEED, dtype=np.uint64)
        raw = np.empty((len(windows), len(self.sizes)), dtype=np.uint64)
        for j in range(1, self.max_n + 1):
            h = (h ^ g[:, -j]) * _MULT
            if j >= self.min_n:
                raw[:, self.max_n - j] = h
        h = raw ^ self._salt
        # FNV leaves a small token in the low bits; a finalizer spreads it to the top.
        h ^= h >> np.uint64(33)
        h *= _FINAL
        h ^= h >> np.uint64(33)
        return (h >> np.uint64(64 - self.bits)).astype(np.int64)

    def same(self, found: np.ndarray, suffix: np.ndarray) -> np.ndarray:
        """[R, S] whether the last m tokens of ``found`` [R, S, max_n] (a window per size)
        equal those of ``suffix`` [R, max_n], for each size m."""
        compared = self.back[None, :] < self.sizes[:, None]  # [S, max_n]
        return ((found == suffix[:, None, :]) | ~compared).all(axis=2)
