"""ShardTracker against a reference that scans every pending shard at each call: the same
complete shards, in the same order, over random interleavings of the reader and results."""

from __future__ import annotations

import random

import pytest

from tokenmill.io.rows import ResultRow
from tokenmill.jobs.shard_tracker import ShardTracker


class _ScanAll:
    """The tracker as it was: ``pop_complete`` looks at every pending shard."""

    def __init__(self, rows_per_shard: int) -> None:
        self.rows_per_shard = rows_per_shard
        self.pending: dict[int, list] = {}  # shard: [seen, results, closed]
        self.last = -1

    def row_seen(self, row: int) -> None:
        shard = row // self.rows_per_shard
        if shard > self.last:
            for p in self.pending.values():
                p[2] = True
            self.last = shard
        self.pending.setdefault(shard, [0, [], False])[0] += 1

    def add_result(self, row: int) -> None:
        self.pending[row // self.rows_per_shard][1].append(row)

    def input_done(self) -> None:
        for p in self.pending.values():
            p[2] = True

    def pop_complete(self) -> list[tuple[int, list[int]]]:
        done = sorted(k for k, p in self.pending.items() if p[2] and len(p[1]) == p[0])
        return [(k, sorted(self.pending.pop(k)[1])) for k in done]


@pytest.mark.parametrize("seed", range(40))
def test_the_same_shards_complete_as_a_full_scan_says(seed: int) -> None:
    rng = random.Random(seed)
    per_shard, rows = rng.choice([1, 3, 4, 10]), rng.randint(0, 120)
    tracker, reference = ShardTracker(per_shard), _ScanAll(per_shard)
    order = list(range(rows))
    for _ in range(rng.randint(0, 3)):  # a row handed out late, after later shards' rows
        if rows > 2:
            i, j = sorted(rng.sample(range(rows), 2))
            order.insert(j, order.pop(i))
    seen: list[int] = []
    read = 0
    done = False
    while not done:
        move = rng.random()
        if move < 0.45 and read < rows:
            tracker.row_seen(order[read])
            reference.row_seen(order[read])
            seen.append(order[read])
            read += 1
        elif move < 0.85 and seen:
            row = seen.pop(rng.randrange(len(seen)))
            tracker.add_result(ResultRow(row_index=row, row_id=str(row)))
            reference.add_result(row)
        elif read == rows and not seen:
            tracker.input_done()
            reference.input_done()
            done = True
        elif read == rows and rng.random() < 0.3:
            tracker.input_done()
            reference.input_done()
        got = [(k, [r.row_index for r in results]) for k, results in tracker.pop_complete()]
        assert got == reference.pop_complete()
    assert tracker.num_pending_rows == 0
