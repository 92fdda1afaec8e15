"""N-gram prompt lookup: draft what followed the last earlier occurrence of a row's suffix.

For a row with tokens t[0..n-1] (prompt and output so far) and the longest m in
[min_n, max_n] whose last m tokens occurred before, ending at position p < n - 1, the drafts
are the tokens that followed that occurrence, t[p+1 .. p+k] (cut at n - 1: only known
tokens). Extraction, rewriting and code edits copy long runs from their input; this drafts
them for free.

    tokens:  the cat sat on the mat . the cat          suffix (m = 2): "the cat"
             ^^^^^^^ p = 1                             drafts: sat on the ...

Each slot keeps an index, [C, H] int32: the hash of an m-gram (for every m) -> the last
position where one with that hash ended (-1: none). A position is indexed once, when it is
known and is no longer the row's last one, so a lookup never finds the suffix itself. A
lookup checks the tokens at the hit, since hashes collide. Everything is numpy over the rows
(and over a row's new positions), never a loop over tokens: the cost of a step is a few
array operations on R x max_n x (new tokens + 1) entries, and a row's prompt is indexed once,
at its first decode step.
"""

from __future__ import annotations

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots

__all__ = ["NgramProposer"]

_MULT = np.uint64(0x100000001B3)  # FNV-1a's 64-bit prime: mixes one token per round
_SEED = np.uint64(0xCBF29CE484222325)
_FINAL = np.uint64(0xFF51AFD7ED558CCD)  # MurmurHash3's 64-bit finalizer constant


class NgramProposer:
    """Up to ``max_drafts`` tokens per row from the row's own tokens, matching suffixes of
    ``min_n`` .. ``max_n`` tokens (longest first). ``table_bits``: log2 of the index's
    entries per slot (2^13 int32 = 32 KiB a slot)."""

    def __init__(
        self, max_drafts: int, min_n: int = 2, max_n: int = 4, table_bits: int = 13
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {max_drafts}")
        self.max_drafts = max_drafts
        self.sizes = tuple(range(max_n, min_n - 1, -1))  # longest first
        self.bits = table_bits
        self._last: np.ndarray | None = None  # [C, 2^bits] int32, allocated on first use
        self._owner = np.empty(0, dtype=object)  # [C] the request a slot's index belongs to
        self._indexed = np.zeros(0, dtype=np.int64)  # [C] m-grams ending before this are in

    def propose(self, slots: BatchSlots, rows: np.ndarray) -> np.ndarray:
        """[R, max_drafts] drafts for the slots ``rows`` (-1 past a row's drafts)."""
        if self._last is None or len(self._owner) != slots.capacity:
            self._last = np.full((slots.capacity, 1 << self.bits), -1, dtype=np.int32)
            self._owner = np.full(slots.capacity, None, dtype=object)
            self._indexed = np.zeros(slots.capacity, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.int64)
        fresh = rows[slots.requests[rows] != self._owner[rows]]  # a new request in the slot
        if len(fresh):
            self._last[fresh] = -1
            self._owner[fresh] = slots.requests[fresh]
            self._indexed[fresh] = 0
        n = slots.num_tokens[rows].astype(np.int64)
        self._index(slots.token_ids, rows, self._indexed[rows], n - 1)
        self._indexed[rows] = np.maximum(n - 1, 0)
        start = self._lookup(slots.token_ids, rows, n)  # [R] first draft's position, -1: none
        pos = start[:, None] + np.arange(self.max_drafts)  # [R, k]
        ok = (start[:, None] >= 0) & (pos < n[:, None])
        drafts = slots.token_ids[rows[:, None], np.where(ok, pos, 0)]
        return np.where(ok, drafts, -1).astype(np.int64)

    def _hash(self, grams: np.ndarray) -> np.ndarray:
        """[P] index entry of each m-gram in ``grams`` [P, m] (m folded in: sizes differ)."""
        h = np.full(len(grams), _SEED ^ np.uint64(grams.shape[1]), dtype=np.uint64)
        for j in range(grams.shape[1]):  # m <= max_n rounds, each over all P grams
            h = (h ^ grams[:, j].astype(np.uint64)) * _MULT
        # FNV leaves a small last token in the low bits; a finalizer spreads it to the top.
        h ^= h >> np.uint64(33)
        h *= _FINAL
        h ^= h >> np.uint64(33)
        return (h >> np.uint64(64 - self.bits)).astype(np.int64)

    def _index(self, tokens: np.ndarray, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray):
        """Index the m-grams ending at positions lo[r] <= p < hi[r] of each row."""
        count = np.maximum(hi - lo, 0)
        total = int(count.sum())
        if not total:
            return
        which = np.repeat(np.arange(len(rows)), count)  # [P] row of each new position
        p = lo[which] + np.arange(total) - np.repeat(np.cumsum(count) - count, count)
        slot = rows[which]
        for m in self.sizes:
            ok = p >= m - 1
            s, e = slot[ok], p[ok]
            grams = tokens[s[:, None], e[:, None] - np.arange(m - 1, -1, -1)]  # [P, m]
            np.maximum.at(self._last, (s, self._hash(grams)), e.astype(np.int32))

    def _lookup(self, tokens: np.ndarray, rows: np.ndarray, n: np.ndarray) -> np.ndarray:
        """[R] the position after the latest earlier occurrence of each row's longest
        matching suffix; -1 where none matches."""
        start = np.full(len(rows), -1, dtype=np.int64)
        for m in self.sizes:
            todo = np.flatnonzero((start < 0) & (n > m))
            if not len(todo):
                continue
            s, end = rows[todo], n[todo] - 1
            suffix = tokens[s[:, None], end[:, None] - np.arange(m - 1, -1, -1)]  # [T, m]
            hit = self._last[s, self._hash(suffix)].astype(np.int64)  # [T]
            at = np.maximum(hit, m - 1)
            found = tokens[s[:, None], at[:, None] - np.arange(m - 1, -1, -1)]
            same = (hit >= m - 1) & (found == suffix).all(axis=1)
            start[todo[same]] = hit[same] + 1
        return start
