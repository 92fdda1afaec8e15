"""ReorderWindow: rows in input order in, longest predicted work first out, none held long.

Why: a job's tail (from 95% of rows done to 100%) is set by the long rows that start late;
the engine's batch is then nearly empty while they finish. Handing long rows to the engine
first lets them overlap with the short ones (the longest-processing-time-first rule).

Each pushed item gets a sequence number (its place in input order); each pop hands one out:

    pushed:  0  1  2  3  4  5  6 ...      window = 3
    pop k:   the item with the most work, unless the oldest one has reached its deadline
             (seq + window <= k): then that one

so an item leaves at most ``window`` pops later than input order would have handed it out,
whatever comes after it. That is what bounds memory downstream: a shard (a range of input
rows) completes at most ``window`` rows late, so the results held for open shards stay
bounded too. The window does not limit how many items are pushed; its owner pushes only
while ``len(window)`` is below its bound. Ties in work go to the older item, so rows of
equal work keep input order. ``by_length=False`` is input order (a plain FIFO).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generic, TypeVar

__all__ = ["ReorderWindow"]

T = TypeVar("T")


class ReorderWindow(Generic[T]):
    """Items with a predicted work; ``pop`` gives the most work first, within ``window``."""

    def __init__(self, window: int, by_length: bool = True) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.by_length = by_length
        self._items: dict[int, T] = {}  # seq -> item, for the items still here
        self._order: deque[int] = deque()  # seqs in input order (some already popped)
        self._heap: list[tuple[float, int]] = []  # (-work, seq); popped seqs skipped lazily
        self._pushed = 0
        self._popped = 0

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: T, work: float) -> None:
        """Add ``item`` (the next in input order) with its predicted ``work``."""
        seq = self._pushed
        self._pushed += 1
        self._items[seq] = item
        self._order.append(seq)
        if self.by_length:
            heapq.heappush(self._heap, (-work, seq))

    def pop(self) -> T:
        """The next item to run. Raises IndexError when the window is empty."""
        if not self._items:
            raise IndexError("pop from an empty ReorderWindow")
        while self._order[0] not in self._items:
            self._order.popleft()
        seq = self._order[0]
        if self.by_length and seq + self.window > self._popped:  # not due yet: most work
            while self._heap[0][1] not in self._items:
                heapq.heappop(self._heap)
            seq = self._heap[0][1]
        self._popped += 1
        item = self._items.pop(seq)
        if len(self._heap) > 2 * len(self._items) + 64:
            self._compact()
        return item

    def _compact(self) -> None:
        """Drop the heap's entries of items that left by their deadline: short items can sit
        under longer ones for ever, and would otherwise pile up one per deadline pop."""
        self._heap = [entry for entry in self._heap if entry[1] in self._items]
        heapq.heapify(self._heap)

    def pop_many(self, n: int) -> list[T]:
        """Up to ``n`` items, in the order ``pop`` gives them."""
        return [self.pop() for _ in range(min(n, len(self._items)))]
