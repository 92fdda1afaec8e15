"""PeekableInput: a job's one read of its input, whose first rows can be looked at before
the run consumes it.

A fresh job sizes its shards from its first rows (shard_size.py) before the reader thread
starts. Read apart, those rows were read twice: once to be weighed, once to be run (on
object storage, a second download of up to 64 MiB). Here they are read once:

    peek(max_rows, max_bytes) ─► iter_input_rows(cfg, schema) ─► first rows, kept ─┐
                                                      (the same read, left open)   │
    rows() ─► the kept rows (each let go as handed out) ─► the rest of that read ◄─┘

Without a ``peek``, ``rows`` is a plain read from the start. The rows are read with the
job's ``schema`` (its Parquet output schema, or None): the rows peeked at are the rows run,
passthrough checks included. An error the peek meets (a storage error, a corrupt file
part-way) is kept and raised by ``rows`` after the rows before it, where the same error
later in the input would be: the run commits what it can and ends through its own failure
path (exit code, failed report), not before it has begun.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.readers import IdOnlyRow, InputConfig, RowPredicate, iter_input_rows
from tokenmill.io.rows import InputRow
from tokenmill.jobs.row_bytes import input_row_bytes

__all__ = ["PeekableInput"]


class PeekableInput:
    """The rows of ``cfg`` read with ``schema``: ``peek`` at the first ones (once, before
    ``rows``), then ``rows`` for all of them, the peeked ones not read again. ``close``
    ends a read that ``rows`` was never called for (a run that failed before its feed)."""

    def __init__(self, cfg: InputConfig, schema: OutputSchema | None) -> None:
        self.cfg = cfg
        self.schema = schema
        self._read: Iterator[InputRow] | None = None  # the open read, once peeked
        self._head: deque[InputRow] = deque()
        self._error: Exception | None = None  # what the peek's read raised, for ``rows``
        self._taken = False

    def peek(self, max_rows: int, max_bytes: int) -> tuple[int, int]:
        """Read the first rows, up to ``max_rows`` of them or until they hold ``max_bytes``
        (``input_row_bytes``; the row that crosses it included), and keep them for
        ``rows``. Returns (rows read, their bytes): the rows before a read error, which
        ``rows`` raises after them (module docstring). RuntimeError when called twice or
        after ``rows`` (those rows would be read again)."""
        if self._read is not None or self._taken:
            raise RuntimeError("PeekableInput.peek: the input's first rows were read already")
        self._read = iter_input_rows(self.cfg, self.schema)
        total = 0
        try:
            for row in self._read:
                self._head.append(row)
                total += input_row_bytes(row)
                if len(self._head) == max_rows or total >= max_bytes:
                    break
        except Exception as exc:  # (the read is over: a generator that raised is closed)
            self._error = exc
        except BaseException:
            self.close()
            raise
        return len(self._head), total

    def rows(self, id_only: RowPredicate | None = None) -> Iterator[InputRow | IdOnlyRow]:
        """Every row of the input in order: the peeked ones, then the rest of the same read
        (or, without a peek, a read from the start). Once only: the peeked rows are let go as
        they are handed out, so they are not held beside the feed's own read-ahead. Without
        a peek, the rows ``id_only`` holds for come as IdOnlyRows (``iter_input_rows``); a
        peeked read was begun in full and goes on so."""
        if self._taken:
            raise RuntimeError("PeekableInput.rows: the input was handed out already")
        self._taken = True
        read: Iterator[InputRow | IdOnlyRow]
        if self._read is not None:
            read = self._read
        elif id_only is None:
            read = iter_input_rows(self.cfg, self.schema)
        else:
            read = iter_input_rows(self.cfg, self.schema, id_only=id_only)
        return self._chain(read)

    def close(self) -> None:
        """End the read, unless ``rows`` handed it out (its consumer ends it then: the reader
        thread may be inside it)."""
        if self._taken or self._read is None:
            return
        self._head.clear()
        close = getattr(self._read, "close", None)
        if close is not None:
            close()

    def _chain(self, read: Iterator[InputRow | IdOnlyRow]) -> Iterator[InputRow | IdOnlyRow]:
        try:
            while self._head:
                yield self._head.popleft()
            if self._error is not None:
                raise self._error
            yield from read
        finally:  # ended early (the feed closed): the read's files are closed now
            close = getattr(read, "close", None)
            if close is not None:
                close()
