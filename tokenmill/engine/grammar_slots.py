"""Grammar indices by batch slot: a step's rows mapped to their grammars with numpy.

``StructuredOutputs`` keeps its grammars at indices (grammar index ─► request, matcher,
counters). A step's rows come with their batch slots (batch_slots.py), so the index of a
row's grammar is remembered per slot, with the request it was looked up for:

    slot s ─► owner[s]: the Request the entry was looked up for
              index[s]: its grammar index, or -1 (a request without structured_output)

A row (request R, slot s) takes ``index[s]`` only when ``owner[s] is R`` (one identity
compare per row, in C); any other row is a miss, looked up by request id (Python per row)
and remembered. The entries are never trusted to follow the slots: with async scheduling a
step's tokens are fed after the next step was scheduled, so a row's slot may by then hold
another request (the row's request finished and a new one took the slot, or it was
preempted and re-admitted elsewhere), and the request is what names the grammar.

What makes a hit right, whatever happened to the slot:

- an entry with index >= 0 is remembered only when that grammar belongs to its owner
  (the grammar's own request is the same object), and dropping a grammar forgets every
  entry holding its index (``forget``) before the index can go to another request;
- an entry with index -1 is remembered only for a request without ``structured_output``,
  which can never get a grammar (``StructuredOutputs.add`` refuses it). A request whose
  grammar was dropped is looked up again each time (a few rows a step: those that
  finished while their next step was in flight).

So a row's index is always the one ``StructuredOutputs`` holds for the row's very request:
another row's grammar (another row's mask) cannot come out of a stale entry.

A step's two lookups (``bitmask``'s and ``feed``'s), CPU: 58 us by id, 25 by slot at 512
rows; 30 and 16 at 256.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["GrammarSlots"]


class GrammarSlots:
    """The grammar index remembered for each batch slot's last looked-up request."""

    def __init__(self) -> None:
        self._owner = np.empty(0, dtype=object)  # [slots] Request or None
        self._index = np.empty(0, dtype=np.int64)  # [slots] grammar index, -1 for none

    def lookup(
        self,
        requests: np.ndarray,
        slots: np.ndarray,
        find: Callable[[np.ndarray], np.ndarray],
        constrained: Callable[[np.ndarray], np.ndarray],
    ) -> np.ndarray:
        """The grammar index of each row [R] int64 (-1: none): ``requests`` [R] object,
        ``slots`` [R] int64 (distinct). Rows whose slot's entry is not their request's are
        looked up with ``find(requests) -> indices`` (by request id, each index checked to
        be that very request's) and remembered, the -1 ones only where
        ``constrained(requests) -> bool`` is False."""
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) and int(slots.max()) >= len(self._index):
            self._grow(int(slots.max()) + 1)
        index = self._index[slots]
        miss = np.flatnonzero(self._owner[slots] != requests)
        if len(miss):
            found = find(requests[miss])
            index[miss] = found
            keep = (found >= 0) | ~constrained(requests[miss])
            at = slots[miss]
            self._owner[at] = np.where(keep, requests[miss], None)
            self._index[at] = np.where(keep, found, -1)
        return index

    def forget(self, indices: list[int]) -> None:
        """Forget the entries holding any of ``indices`` (grammars being dropped: their
        indices may go to other requests next)."""
        if not indices or not len(self._index):
            return
        # A table of the dropped indices (np.isin costs ~50 us a call, CPU, this ~5): its
        # last entry, False, stands for -1 and for any index past the dropped ones.
        dropped = np.zeros(max(indices) + 2, dtype=np.bool_)
        dropped[indices] = True
        stale = np.flatnonzero(dropped[np.minimum(self._index, len(dropped) - 1)])
        self._owner[stale] = None
        self._index[stale] = -1

    def clear(self) -> None:
        """Forget every entry (and the requests they hold)."""
        self._owner[:] = None
        self._index[:] = -1

    def _grow(self, size: int) -> None:
        old = len(self._index)
        self._owner = np.concatenate([self._owner, np.full(size - old, None, dtype=object)])
        self._index = np.concatenate([self._index, np.full(size - old, -1, dtype=np.int64)])
