"""N-gram prompt lookup: draft what followed the last earlier occurrence of a row's suffix.

For a row with tokens t[0..n-1] (prompt and output so far) and the longest m in
[min_n, max_n] whose last m tokens occurred before, ending at position p < n - 1, the drafts
are the tokens that followed that occurrence, t[p+1 .. p+k]; past the known tokens, the
row repeats t[p+1 .. n-1] (a cycle as short as the gap between the two occurrences).
Extraction, rewriting and code edits copy long runs from their input; this drafts them for
free.

    tokens:  the cat sat on the mat . the cat          suffix (m = 2): "the cat"
             ^^^^^^^ p = 1                             drafts: sat on the ...

Each slot keeps an index, [C, H] int64: the hash of an m-gram (for every m) -> the last
position where one with that hash ended and that gram's print (more bits of its hash,
gram_hash.py), as ``position << 32 | print`` (-1: none), one word an entry, so indexing a
token is one scattered write and a lookup one gather (two tables, positions and prints,
took 2.9 of a 6.6 ms catch-up of 51,200 positions, CPU). A position is indexed once, when
it is known and is no longer the row's last one, so a lookup never finds the suffix
itself. A hit whose print differs is another gram that shares the entry, and is no
match. Everything is numpy over the rows
(and over a row's new positions), never a loop over tokens: the cost of a step is a few
array operations on R x max_n x (new tokens + 1) entries, and a row's prompt is indexed once,
at its first decode step.
"""

from __future__ import annotations

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.runs import within_runs
from tokenmill.engine.spec_decode.gram_hash import GramHasher

__all__ = ["NgramProposer"]


class NgramProposer:
    """Up to ``max_drafts`` tokens per row from the row's own tokens, matching suffixes of
    ``min_n`` .. ``max_n`` tokens (longest first). ``table_bits``: log2 of the index's
    entries per slot (2^13 words of a position and a print: 64 KiB a slot)."""

    def __init__(
        self, max_drafts: int, min_n: int = 2, max_n: int = 4, table_bits: int = 13
    ) -> None:
        if max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {max_drafts}")
        self.max_drafts = max_drafts
        self.hasher = GramHasher(min_n, max_n, table_bits)
        self._table: np.ndarray | None = None  # [C, 2^bits] int64 (the top), on first use
        self._owner = np.empty(0, dtype=object)  # [C] the request a slot's index belongs to
        self._indexed = np.zeros(0, dtype=np.int64)  # [C] m-grams ending before this are in

    def propose(self, slots: BatchSlots, rows: np.ndarray) -> np.ndarray:
        """[R, max_drafts] drafts for the slots ``rows`` (-1 past a row's drafts)."""
        return self.predict(slots, rows, self.max_drafts)

    def predict(self, slots: BatchSlots, rows: np.ndarray, count: int) -> np.ndarray:
        """[R, count]: what followed the earlier occurrence of each row's suffix, for as
        many tokens as asked (-1 past them)."""
        start, _ = self.match(slots, rows)
        return self.drafts_from(slots.token_ids, np.asarray(rows, dtype=np.int64), start,
                                slots.num_tokens[rows].astype(np.int64), count)  # fmt: skip

    def match(self, slots: BatchSlots, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Index the rows' new tokens, then look their suffixes up: ([R] the position after
        each row's match, -1 where none; [R] the matched gram's length, 0 where none)."""
        if self._table is None or len(self._owner) != slots.capacity:
            entries = 1 << self.hasher.bits
            self._table = np.full((slots.capacity, entries), -1, dtype=np.int64)
            self._owner = np.full(slots.capacity, None, dtype=object)
            self._indexed = np.zeros(slots.capacity, dtype=np.int64)
        rows = np.asarray(rows, dtype=np.int64)
        fresh = rows[slots.requests[rows] != self._owner[rows]]  # a new request in the slot
        if len(fresh):
            self._table[fresh] = -1
            self._owner[fresh] = slots.requests[fresh]
            self._indexed[fresh] = 0
        tokens = slots.token_ids
        n = slots.num_tokens[rows].astype(np.int64)
        # Positions to index (known, not the last: [indexed, n - 1)), then each row's last
        # position (its suffix, to look up): one gather and one hash pass for both.
        lo, hi = self._indexed[rows], np.maximum(n - 1, 0)
        count = np.maximum(hi - lo, 0)
        which = np.repeat(np.arange(len(rows)), count)
        new = lo[which] + within_runs(count)
        slot = np.concatenate([rows[which], rows])
        pos = np.concatenate([new, np.maximum(n - 1, 0)])
        h = self.hasher
        width = tokens.shape[1]
        flat = tokens.reshape(-1)  # 1-d takes: cheaper than 2-d fancy indexing
        # The windows gathered as [max_n, P + R] (oldest first; before a row's start its
        # first token), the hasher's own layout: 256 rows catching up on 200 tokens each
        # took 6.3 ms where [P + R, max_n] windows took 7.7-8.4 (2-core CPU,
        # bench/proposer_catchup.py, BENCHMARKS session 42).
        start = slot * width
        at = np.maximum(start + pos - h.back[:, None], start)  # [max_n, P + R]
        columns = flat.take(at).astype(np.int64)
        hashes, prints = h.of_columns(columns)  # [P + R, S] each
        whole = pos[:, None] >= h.sizes - 1  # the m-gram lies inside the row
        p = len(new)
        entries = self._table.shape[1]
        keys = slot[:p, None] * entries + hashes[:p]  # [P, S]
        words = (new[:, None] << 32) | prints[:p]  # [P, S] position and print
        fill = whole[:p]
        if not fill.all():  # (only rows indexed from their start have grams past it)
            keys, words = keys[fill], words[fill]
        # Positions ascend within a row, so where a key repeats the latest is written last
        # (numpy assigns a 1-d index array in order).
        self._table.reshape(-1)[keys.reshape(-1)] = words.reshape(-1)
        self._indexed[rows] = hi
        at = rows[:, None] * entries + hashes[p:]  # [R, S] the suffixes' entries
        found = self._table.reshape(-1).take(at)
        hit = found >> 32  # where each ended, -1: none
        same = ((found & 0xFFFFFFFF) == prints[p:]) & (hit >= 0) & whole[p:]
        same &= n[:, None] > h.sizes
        first = same.argmax(axis=1)  # the longest size that matches
        r = np.arange(len(rows))
        matched = same[r, first]
        return np.where(matched, hit[r, first] + 1, -1), np.where(matched, h.sizes[first], 0)

    def drafts_from(
        self,
        tokens: np.ndarray,
        rows: np.ndarray,
        start: np.ndarray,
        n: np.ndarray,
        count: int | None = None,
    ) -> np.ndarray:
        """[R, count (default max_drafts)]: tokens start[r] .. of each row. Where they run
        into the row's end (n[r] known tokens) the row is taken to repeat what it has since
        the match (its suffix matched the tokens before start: the same reasoning, one draft
        later, would match again), so a short cycle drafts as far as one asks."""
        period = np.maximum(n - start, 1)[:, None]
        cols = start[:, None] + np.arange(self.max_drafts if count is None else count) % period
        ok = start[:, None] >= 0
        drafts = tokens.reshape(-1).take(rows[:, None] * tokens.shape[1] + np.where(ok, cols, 0))
        return np.where(ok, drafts, -1).astype(np.int64)
