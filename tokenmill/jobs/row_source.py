"""What an executor pulls rows from: ``take`` what is ready, without waiting when it is busy.

Two sources: the runner's RowFeed (a reader thread reads and prepares the input ahead) and
RowList (rows already in memory, e.g. one chunk of a Ray replica, prepared as taken).
Items are ReadyRows (token ids and sampling parameters attached), ResultRows (rows that
failed while being prepared: they only need writing) or plain InputRows (a source that does
not prepare: the executor's replicas do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.ready_rows import ReadyRow

__all__ = ["FeedItem", "Prepare", "RowList", "RowSource", "row_index_of"]

FeedItem = InputRow | ReadyRow | ResultRow
Prepare = Callable[[list[InputRow]], list[ReadyRow | ResultRow]]


def row_index_of(item: FeedItem) -> int:
    """The input row index of any feed item."""
    return item.row.row_index if isinstance(item, ReadyRow) else item.row_index


@runtime_checkable
class RowSource(Protocol):
    @property
    def exhausted(self) -> bool:
        """Every row has been taken: ``take`` returns nothing any more."""
        ...

    def take(self, max_rows: int, wait: bool) -> list[FeedItem]:
        """Up to ``max_rows`` items in input order. With ``wait`` it blocks briefly (a
        fraction of a second) for the first one, else it returns only what is ready now."""
        ...


class RowList:
    """``rows`` (good InputRows), prepared by ``prepare`` as they are taken."""

    def __init__(self, rows: Iterable[InputRow], prepare: Prepare) -> None:
        self._rows = iter(rows)
        self._prepare = prepare
        self._exhausted = False

    @property
    def exhausted(self) -> bool:
        return self._exhausted

    def take(self, max_rows: int, wait: bool) -> list[FeedItem]:
        batch: list[InputRow] = []
        while len(batch) < max_rows:
            row = next(self._rows, None)
            if row is None:
                self._exhausted = True
                break
            batch.append(row)
        return list(self._prepare(batch)) if batch else []
