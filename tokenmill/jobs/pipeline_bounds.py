"""How far each stage of a local run may get ahead of the next: the bounds on host memory.

    reader thread ─► ready rows (read_ahead_rows) ─► engine (2 * max_num_seqs in flight)
       ─► shard tracker (results of open shards) ─► writer thread (queued_shards shards)

Every queue is bounded in rows, so a run holds about ``read_ahead_rows + 2 * batch_rows +
2 * max_num_seqs`` rows before the engine and a few shards after it, whatever the input's
size. The defaults follow ``engine.max_num_seqs``: enough rows ready to refill the batch
many steps over, few enough to stay small next to the engine's own memory.

The queues before the engine are bounded in bytes too (row_bytes.py estimates a row's):
rows of a 5 MB passthrough column each filled 5.6 GB within the row bounds (an audit). A
batch ends at ``batch_bytes``, the read-ahead queue holds up to ``read_ahead_bytes`` and the
planner's window (with what one ``take`` reads) up to ``window_bytes``; each lets one row
through however large, so a huge row still runs. Small rows never reach the byte bounds:
256 rows of 1 KB are 256 KB. The rows in the engine keep their passthrough values until
their results: the executor adds no row while those it has in flight hold ``engine_bytes``
(one take past it at most, and always one row, so a huge row still runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["PipelineBounds"]

_BATCH_ROWS = 64  # rows templated and tokenized in one call: enough to amortise the call
_MIN_READ_AHEAD = 256
_MIB = 1 << 20


@dataclass(frozen=True)
class PipelineBounds:
    batch_rows: int = _BATCH_ROWS  # rows read and prepared (template, tokens) together
    read_ahead_rows: int = 2 * _MIN_READ_AHEAD  # ready rows waiting for the engine
    queued_shards: int = 2  # complete shards waiting for the writer thread
    batch_bytes: int = 16 * _MIB  # a batch ends once its rows hold this much
    read_ahead_bytes: int = 128 * _MIB  # ready rows waiting for the engine, in bytes
    window_bytes: int = 128 * _MIB  # rows in the planner's window and read by one take
    engine_bytes: int = 256 * _MIB  # rows in the engine: no row is added past it

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelineBounds.{f.name} must be an int >= 1, got {value!r}")

    @classmethod
    def for_engine(cls, max_num_seqs: int) -> PipelineBounds:
        """The bounds of a run whose engine batches up to ``max_num_seqs`` requests."""
        read_ahead = max(2 * max_num_seqs, _MIN_READ_AHEAD)
        return cls(batch_rows=min(_BATCH_ROWS, read_ahead), read_ahead_rows=read_ahead)

    @property
    def read_ahead_batches(self) -> int:
        """The read-ahead queue's length, in batches."""
        return math.ceil(self.read_ahead_rows / self.batch_rows)
