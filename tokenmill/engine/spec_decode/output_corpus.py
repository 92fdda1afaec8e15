"""OutputCorpus: the outputs of requests already finished in this engine, for drafting.

Batch jobs repeat their output's structure row after row (a JSON record per row, a label, a
fixed answer template): row n + 1 can draft from rows 1 .. n. Finished outputs go into a ring
buffer of tokens, each followed by a separator, and an index maps the hash of every m-gram
in it to the latest position where one ended, and that gram's print (the shared GramHasher,
a single table):

    store:  [ {"name": "Ada", "age": 31} | {"name": "Bo", "age": 4 ... ]      | separator
    a row ending in  , "age":  finds the latest earlier  , "age":  and drafts what followed

Memory is bounded: ``capacity`` tokens (int64: 8 MiB for the default million), the oldest
overwritten first, and an index table of as many entries (12 bytes each); an index entry
pointing at an overwritten position is stale and ignored, and one whose print differs holds
another gram. Drafts stop at a separator: one output never continues into the next.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np

from tokenmill.engine.spec_decode.gram_hash import GramHasher

__all__ = ["OutputCorpus"]

_SEPARATOR = -1


class OutputCorpus:
    """Finished outputs, up to ``capacity`` tokens, indexed by m-grams of ``min_n`` ..
    ``max_n`` tokens in a table of 2^``table_bits`` entries."""

    def __init__(
        self, capacity: int = 1 << 20, min_n: int = 3, max_n: int = 8, table_bits: int = 20
    ) -> None:
        if capacity < 2 * max_n:
            raise ValueError(f"OutputCorpus: capacity {capacity} is below 2 x max_n ({max_n})")
        self.hasher = GramHasher(min_n, max_n, table_bits)
        self.capacity = capacity
        self._store = np.full(capacity, _SEPARATOR, dtype=np.int64)
        self._end = np.full(1 << table_bits, -1, dtype=np.int64)  # entry -> absolute position
        self._print = np.zeros(1 << table_bits, dtype=np.uint32)  # entry -> its gram's print
        self.written = 0  # tokens ever written (absolute position of the next one)

    def add(self, outputs: Sequence[Sequence[int] | np.ndarray]) -> None:
        """Append finished outputs (each then a separator) and index their m-grams."""
        outputs = [o for o in outputs if len(o)]
        if not outputs:
            return
        tokens = _joined(outputs)[-self.capacity :]
        first = self.written
        at = first + np.arange(len(tokens))  # absolute positions
        self._store[at % self.capacity] = tokens
        self.written += len(tokens)
        # Index the grams ending at each new real token (a gram may reach back into older
        # tokens; one that holds a separator never matches a row's suffix, and is left in).
        real = at[tokens != _SEPARATOR]
        h = self.hasher
        windows = self._tokens(real[:, None] - h.back)  # [P, max_n]
        entries, prints = h(windows)  # [P, S] each
        valid = self._whole(windows)
        self._end[entries[valid]] = np.broadcast_to(real[:, None], entries.shape)[valid]
        self._print[entries[valid]] = prints[valid]  # (in order, as the positions)

    def lookup(self, suffix: np.ndarray, max_drafts: int) -> tuple[np.ndarray, np.ndarray]:
        """For rows ending in ``suffix`` [R, max_n] (oldest first; a short row padded with
        the separator on the left): ([R, max_drafts] drafts, -1 past them; [R] the length of
        the longest matched gram, 0 where none matched)."""
        h = self.hasher
        entries, prints = h(suffix)  # [R, S] each
        end = self._end.take(entries)  # [R, S] absolute positions, -1: empty
        live = (end >= 0) & (end > self.written - self.capacity + h.max_n)
        same = (self._print.take(entries) == prints) & live & self._whole(suffix)
        first = same.argmax(axis=1)  # the longest size that matches
        r = np.arange(len(suffix))
        matched = same[r, first]
        cols = end[r, first][:, None] + 1 + np.arange(max_drafts)  # [R, k]
        drafts = np.where(matched[:, None] & (cols < self.written), self._tokens(cols), -1)
        drafts = np.where(np.cumprod(drafts != _SEPARATOR, axis=1).astype(bool), drafts, -1)
        return drafts, np.where(matched, h.sizes[first], 0)

    def _whole(self, windows: np.ndarray) -> np.ndarray:
        """[P, S] whether each size's gram, the last m tokens of a window [P, max_n], holds
        no separator (lies within one output)."""
        newest_first = (windows != _SEPARATOR)[:, ::-1]
        return newest_first.cumprod(axis=1)[:, self.hasher.sizes - 1].astype(bool)

    def _tokens(self, positions: np.ndarray) -> np.ndarray:
        """Tokens at absolute positions (any shape); the separator before 0 or once
        overwritten."""
        gone = (positions < 0) | (positions < self.written - self.capacity)
        return np.where(gone, _SEPARATOR, self._store[positions % self.capacity])


def _joined(outputs: Sequence[Sequence[int] | np.ndarray]) -> np.ndarray:
    """[sum of the lengths + len(outputs)] int64: the outputs one after another, each
    followed by a separator. Lists are converted in C by one growing array (an
    ``np.asarray`` and ``np.append`` per output took ~60% longer, CPU)."""
    flat = array.array("q")
    for output in outputs:
        flat.extend(output)
        flat.append(_SEPARATOR)
    return np.frombuffer(flat, dtype=np.int64)
