"""Which shards are complete: every row of the shard's range has a result.

    rows:    0 .......... R-1 | R ......... 2R-1 | 2R ...
    shards:        0          |        1         |   2
A shard is complete once the reader has moved past its last row (or the input ended) and
each row it saw there has a result. Shards already in the manifest are never tracked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.io.rows import ResultRow


@dataclass
class _Pending:
    seen: int = 0
    results: list[ResultRow] = field(default_factory=list)
    closed: bool = False  # the reader is past this shard's range


class ShardTracker:
    def __init__(self, rows_per_shard: int) -> None:
        self.rows_per_shard = rows_per_shard
        self._pending: dict[int, _Pending] = {}
        self._last_shard = -1

    def shard_of(self, row_index: int) -> int:
        return row_index // self.rows_per_shard

    def row_seen(self, row_index: int) -> None:
        """The reader handed out ``row_index`` (to be computed or failed)."""
        shard = self.shard_of(row_index)
        if shard > self._last_shard:
            for pending in self._pending.values():
                pending.closed = True
            self._last_shard = shard
        self._pending.setdefault(shard, _Pending()).seen += 1

    def add_result(self, result: ResultRow) -> None:
        self._pending[self.shard_of(result.row_index)].results.append(result)

    def input_done(self) -> None:
        for pending in self._pending.values():
            pending.closed = True

    def pop_complete(self) -> list[tuple[int, list[ResultRow]]]:
        """Complete shards (index, results sorted by row index), removed from tracking."""
        done = [k for k, p in self._pending.items() if p.closed and len(p.results) == p.seen]
        out = []
        for k in sorted(done):
            pending = self._pending.pop(k)
            out.append((k, sorted(pending.results, key=lambda r: r.row_index)))
        return out

    @property
    def num_pending_rows(self) -> int:
        return sum(p.seen - len(p.results) for p in self._pending.values())
