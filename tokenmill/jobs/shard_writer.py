"""ShardWriter: complete shards are encoded, written and recorded on a writer thread.

    engine thread                          writer thread
    submit(shard, results) ─► queue ─►     commit_shard (data file, error file if any)
      (blocks while ``max_queued``            ─► manifest.commit_shard(k, record)
       shards wait: backpressure)
    check() / finish() ◄── the writer's exception, re-raised as it was raised

The commit protocol is unchanged (files first, then the manifest naming them), and shards are
committed in the order they complete, one at a time. While the writer runs, it alone touches
the manifest; the runner reads it again after ``finish``. ``abandon`` (a second SIGTERM)
stops it without waiting: no record is written after it, and a shard's files being written
then are left for a rerun to recompute. A record already being written (the commit point)
is waited for by ``settle``, and counted: the run's last report reads the counts after it,
so they are what a rerun finds (they once stopped before a record that landed after the
stop: the report said one shard fewer than the manifest).

``still_held`` (the output lock's ``check_held``) runs before a shard's files and again
before its record: a run whose lock file was removed meanwhile may share the output with
another run, and must stop before it overwrites that run's files or manifest.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.rows import ResultRow
from tokenmill.io.storage import OutputStore
from tokenmill.jobs.lock import LockLostError
from tokenmill.jobs.manifest import Manifest
from tokenmill.jobs.shard_commit import commit_shard

__all__ = ["ShardWriter"]

log = logging.getLogger("tokenmill.jobs")

_POLL_S = 0.1  # how often a wait on the writer re-checks it (and lets signals in)
_END = None  # queued by ``finish``: nothing more will come


class ShardWriter:
    """Commits shards of ``fmt`` to ``store`` and records them in ``manifest`` (saved after
    each); Parquet shards are written with ``schema``, the job's output schema.
    ``shards_committed`` and ``rows_committed`` count what this writer committed."""

    def __init__(
        self,
        store: OutputStore,
        manifest: Manifest,
        fmt: str,
        max_queued: int,
        schema: OutputSchema | None = None,
        still_held: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.fmt = fmt
        self.schema = schema
        self._still_held = still_held  # raises when the output's lock is no longer this run's
        self.shards_committed = 0
        self.rows_committed = 0
        self._queue: queue.Queue[tuple[int, list[ResultRow]] | None] = queue.Queue(max_queued)
        self._error: BaseException | None = None
        self._abandoned = threading.Event()
        # held over a record's write and its count: ``settle`` waits for both or neither
        self._recording = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tokenmill-writer", daemon=True)
        self._thread.start()

    def submit(self, shard: int, results: list[ResultRow]) -> None:
        """Queue complete shard ``shard`` (its results in row order). Blocks while the queue
        is full. Raises the writer's error if it failed."""
        self._put((shard, results))

    @property
    def abandoned(self) -> bool:
        return self._abandoned.is_set()

    @property
    def error(self) -> BaseException | None:
        """What the writer raised (it then stopped), or None."""
        return self._error

    def check(self) -> None:
        """Raise the writer's error, if it failed."""
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """Commit every queued shard, then stop. Raises the writer's error if it failed."""
        if self._thread.is_alive():
            self._put(_END)
        while self._thread.is_alive():  # a join in slices: a signal handler may run between
            self._thread.join(_POLL_S)
        self.check()

    def finish_quietly(self) -> None:
        """``finish`` for a run that is failing anyway: the writer's own error is logged, not
        raised (anything else raised while waiting, e.g. by a signal handler, is)."""
        try:
            self.finish()
        except Exception as exc:
            if exc is not self._error:
                raise
            log.warning(
                "committing the last complete shards failed: %s: %s", type(exc).__name__, exc
            )

    def abandon(self) -> None:
        """Stop now, without waiting (a record being written may hang on the store): no
        record is written after this, queued shards are dropped for a rerun. A record being
        written as this is called may still land; ``settle`` waits for it."""
        self._abandoned.set()
        try:
            while True:  # what is queued is dropped; make room for the end marker
                self._queue.get_nowait()
        except queue.Empty:
            pass
        try:
            self._queue.put_nowait(_END)
        except queue.Full:  # only the writer thread takes from the queue: it cannot refill
            pass

    def settle(self, timeout: float = -1) -> bool:
        """After ``abandon``: wait until no record is being written (the one in progress, if
        any, is then in the manifest and the counts); none is written later, so the manifest
        here and ``shards_committed`` are final, what a rerun finds. Returns False when
        ``timeout`` (seconds; -1: none) passed first, the counts then not final."""
        if not self._recording.acquire(timeout=timeout):
            return False
        self._recording.release()
        return True

    def _put(self, item: tuple[int, list[ResultRow]] | None) -> None:
        while True:
            self.check()
            if not self._thread.is_alive():
                return
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _run(self) -> None:
        try:
            while not self._abandoned.is_set():
                item = self._queue.get()
                if item is _END or self._abandoned.is_set():
                    return
                shard, results = item
                self._still_held()
                record = commit_shard(
                    self.store,
                    shard,
                    results,
                    self.fmt,
                    self.manifest.rows_per_shard,
                    self.schema,
                )
                with self._recording:  # written and counted, or neither (settle)
                    if self._abandoned.is_set():
                        return
                    self._still_held()
                    compacted = self.manifest.write_record(self.store, shard, record)
                    self.manifest.add_record(shard, record, compacted)
                    self.shards_committed += 1
                    self.rows_committed += len(results)
                if compacted:
                    self.manifest.drop_journal(self.store)
        except BaseException as exc:  # re-raised on the engine thread by check() / finish()
            self._error = exc
            if isinstance(exc, Exception) and not isinstance(exc, LockLostError):
                try:  # a write that failed as another run took the output (its start
                    self._still_held()  # removes temporary files) says so, not the symptom
                except LockLostError as lost:
                    lost.__cause__ = exc
                    self._error = lost
