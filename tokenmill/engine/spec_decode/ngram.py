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
        self.min_n, self.max_n = min_n, max_n
        self.sizes = tuple(range(max_n, min_n - 1, -1))  # longest first
        self._sizes = np.array(self.sizes, dtype=np.int64)
        self._salt = self._sizes.astype(np.uint64)  # the size, mixed in by the finalizer
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
        tokens = slots.token_ids
        n = slots.num_tokens[rows].astype(np.int64)
        # Positions to index (known, not the last: [indexed, n - 1)), then each row's last
        # position (its suffix, to look up): one gather and one hash pass for both.
        lo, hi = self._indexed[rows], np.maximum(n - 1, 0)
        count = np.maximum(hi - lo, 0)
        which = np.repeat(np.arange(len(rows)), count)
        new = lo[which] + np.arange(len(which)) - np.repeat(np.cumsum(count) - count, count)
        slot = np.concatenate([rows[which], rows])
        pos = np.concatenate([new, np.maximum(n - 1, 0)])
        back = np.arange(self.max_n - 1, -1, -1)  # window columns: oldest .. newest token
        flat = tokens.reshape(-1)  # 1-d takes: cheaper than 2-d fancy indexing
        width = tokens.shape[1]
        grams = flat.take(slot[:, None] * width + np.maximum(pos[:, None] - back, 0))
        hashes = self._hashes(grams)  # [P + R, S]
        whole = pos[:, None] >= self._sizes - 1  # the m-gram lies inside the row
        p = len(new)
        fill = whole[:p]
        keys = (slot[:p, None] * self._last.shape[1] + hashes[:p])[fill]
        # Positions ascend within a row, so where a key repeats the latest is written last
        # (numpy assigns a 1-d index array in order).
        self._last.reshape(-1)[keys] = np.broadcast_to(new[:, None], fill.shape)[fill]
        self._indexed[rows] = hi
        start = self._lookup(tokens, rows, n, grams[p:], hashes[p:], whole[p:])
        cols = start[:, None] + np.arange(self.max_drafts)  # [R, k]
        ok = (start[:, None] >= 0) & (cols < n[:, None])
        drafts = flat.take(rows[:, None] * width + np.where(ok, cols, 0))
        return np.where(ok, drafts, -1).astype(np.int64)

    def _hashes(self, grams: np.ndarray) -> np.ndarray:
        """[P, S] index entries of the m-grams ending at each window's last token, one per
        size m (longest first): the newest token mixed first, one round a token, so the
        shorter grams' hashes fall out on the way to the longest; one finalizer for all."""
        g = grams.astype(np.uint64)
        h = np.full(len(grams), _SEED, dtype=np.uint64)
        raw = np.empty((len(grams), len(self.sizes)), dtype=np.uint64)
        for j in range(1, self.max_n + 1):
            h = (h ^ g[:, -j]) * _MULT
            if j >= self.min_n:
                raw[:, self.max_n - j] = h
        return self._final(raw ^ self._salt)

    def _final(self, h: np.ndarray) -> np.ndarray:
        # FNV leaves a small token in the low bits; a finalizer spreads it to the top.
        h = h ^ (h >> np.uint64(33))
        h = h * _FINAL
        h = h ^ (h >> np.uint64(33))
        return (h >> np.uint64(64 - self.bits)).astype(np.int64)

    def _lookup(
        self,
        tokens: np.ndarray,
        rows: np.ndarray,
        n: np.ndarray,
        suffix: np.ndarray,
        hashes: np.ndarray,
        whole: np.ndarray,
    ) -> np.ndarray:
        """[R] the position after the latest earlier occurrence of each row's longest
        matching suffix; -1 where none matches. ``suffix`` [R, max_n] is each row's last
        tokens, ``hashes`` [R, S] their m-grams' entries, ``whole`` [R, S] which fit."""
        hit = self._last[rows[:, None], hashes].astype(np.int64)  # [R, S] where it ended
        back = np.arange(self.max_n - 1, -1, -1)
        at = rows[:, None, None] * tokens.shape[1] + np.maximum(hit[:, :, None] - back, 0)
        found = tokens.reshape(-1).take(at)  # [R, S, max_n]
        # Size m compares the last m columns of the two windows.
        compared = back[None, :] < self._sizes[:, None]  # [S, max_n]
        same = ((found == suffix[:, None, :]) | ~compared).all(axis=2)
        same &= whole & (hit >= self._sizes - 1) & (n[:, None] > self._sizes)
        first = same.argmax(axis=1)  # the longest size that matches
        matched = same[np.arange(len(rows)), first]
        return np.where(matched, hit[np.arange(len(rows)), first] + 1, -1)
