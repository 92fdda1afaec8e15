"""Hashes of the m-grams that end at a token, for every size m at once (numpy, no loops over
tokens). The n-gram proposer's per-row index and the job-wide output corpus both key their
tables with it: a gram's entry (the hash's top ``bits`` bits) and its print (the low 32
bits), stored beside what the entry points at. A hit counts only where the prints agree too,
so two grams that share an entry (a table of 2^13 entries fills up in a long row) are told
apart without reading their tokens back: two different grams agree on both one time in
2^(32 + bits). A false hit costs a wrong draft, which verification rejects: output never
depends on a draft, only the step's speed does."""

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

    def __call__(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[P, S] entries (int64) and [P, S] prints (uint32) of the m-grams ending at each
        window's last token; ``windows`` [P, max_n] holds the tokens oldest .. newest. The
        newest token is mixed first, one round a token, so the shorter grams' hashes fall
        out on the way to the longest."""
        return self.of_columns(np.ascontiguousarray(windows.T, dtype=np.int64))

    def of_columns(self, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``__call__`` of the windows ``columns.T``: ``columns`` [max_n, P] int64,
        C-contiguous, a row per window position (oldest first). Computed a size at a time
        over all windows, in place, on contiguous rows: 1.8x faster than over [P, S]
        columns (3.2 -> 1.8 ms for 76,000 windows of random tokens, on a 2-core CPU)."""
        g = columns.view(np.uint64)  # (a token of -1 wraps, as a cast would)
        raw = np.empty((len(self.sizes), g.shape[1]), dtype=np.uint64)  # [S, P]
        h = np.full(g.shape[1], _SEED, dtype=np.uint64)
        for j in range(1, self.max_n + 1):
            h ^= g[self.max_n - j]
            h *= _MULT
            if j >= self.min_n:
                raw[self.max_n - j] = h
        raw ^= self._salt[:, None]
        # FNV leaves a small token in the low bits; a finalizer spreads it to the top.
        raw ^= raw >> np.uint64(33)
        raw *= _FINAL
        raw ^= raw >> np.uint64(33)
        prints = raw.astype(np.uint32).T  # the low bits
        raw >>= np.uint64(64 - self.bits)
        return raw.T.astype(np.int64), prints  # [P, S] each (column-major in memory)
