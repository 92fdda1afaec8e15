"""ReadAhead: a background thread runs an iterator of batches into a bounded queue.

    worker thread:  batches ─► put (blocks while ``max_batches`` wait) ─► queue ─► get()
                    the end ─► get() returns None and ``exhausted`` turns True
                    an exception ─► get() re-raises it, after the batches made before it

At most ``max_batches`` batches wait in the queue and one more is in the worker's hands, so
memory stays bounded however long the input. With ``size_of``, the batches waiting also hold
at most ``max_bytes`` together, or a single batch when one alone is larger: a count of
batches bounds nothing when a batch can be any size (wide rows). The worker is a daemon
thread: a run that stops at once (a second SIGTERM) never waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["ReadAhead"]

log = logging.getLogger("tokenmill.jobs")

T = TypeVar("T")

_POLL_S = 0.1  # how often a blocked worker re-checks ``close``
_DONE = object()  # ``next``'s default: the iterator has ended


class _End:
    """The worker's last item: the iterator ended (``error`` None) or raised ``error``."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class ReadAhead(Generic[T]):
    """Runs ``batches`` on a daemon thread named ``name``, at most ``max_batches`` ahead and,
    with ``size_of`` (a batch's bytes), at most ``max_bytes`` of batches ahead (never fewer
    than one batch)."""

    def __init__(
        self,
        batches: Iterator[T],
        max_batches: int,
        name: str,
        size_of: Callable[[T], int] | None = None,
        max_bytes: int = 0,
    ) -> None:
        if max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        if size_of is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1 with size_of, got {max_bytes}")
        self._batches = batches
        self._queue: queue.Queue[tuple[T | _End, int]] = queue.Queue(maxsize=max_batches)
        self._size_of = size_of
        self._max_bytes = max_bytes
        self._room = threading.Condition()  # guards ``queued_bytes``; get() notifies
        self.queued_bytes = 0  # the sizes of the batches in the queue
        self._stop = threading.Event()
        self.exhausted = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def get(self, timeout: float) -> T | None:
        """The next batch, or None when none came within ``timeout`` seconds (0: do not wait)
        or the iterator has ended (then ``exhausted`` is True). Re-raises the iterator's
        exception, once, in order."""
        if self.exhausted:
            return None
        try:
            item, size = (
                self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            )
        except queue.Empty:
            return None
        self._release(size)
        if isinstance(item, _End):
            self.exhausted = True
            if item.error is not None:
                raise item.error
            return None
        return item

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker: it drops what it holds and ends at its next batch. Waits up to
        ``timeout`` seconds for it (a read hung in a storage client is left to the daemon)."""
        self._stop.set()
        self.exhausted = True
        try:  # make room, so that a worker blocked on a full queue sees the stop
            while True:
                self._release(self._queue.get_nowait()[1])
        except queue.Empty:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.debug(
                "%s did not stop within %g s; left to finish as a daemon",
                self._thread.name,
                timeout,
            )

    def _run(self) -> None:
        end = _End(None)
        try:
            while not self._stop.is_set():  # checked before each batch: close() stops it
                batch = next(self._batches, _DONE)
                if batch is _DONE:
                    break
                if not self._put(batch):
                    return
        except BaseException as exc:  # handed to get(), which re-raises it in the caller
            end = _End(exc)
        finally:
            self._close_batches()
        if not self._stop.is_set():
            self._put(end)

    def _close_batches(self) -> None:
        """A generator's files are closed now, on this thread (not whenever it is collected)."""
        close = getattr(self._batches, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception as exc:  # the run is ending anyway; what it raised is reported
            log.debug("closing the input: %s: %s", type(exc).__name__, exc)

    def _put(self, item: T | _End) -> bool:
        """Queue ``item`` when there is room (in batches and in bytes); False when closed
        meanwhile."""
        size = 0
        if self._size_of is not None and not isinstance(item, _End):
            size = self._size_of(item)
            with self._room:  # an empty queue takes any batch: a huge row still runs
                while self.queued_bytes > 0 and self.queued_bytes + size > self._max_bytes:
                    if self._stop.is_set():
                        return False
                    self._room.wait(_POLL_S)
                self.queued_bytes += size
        while not self._stop.is_set():
            try:
                self._queue.put((item, size), timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _release(self, size: int) -> None:
        """A batch of ``size`` bytes left the queue: room for the worker's next."""
        if size:
            with self._room:
                self.queued_bytes -= size
                self._room.notify()
