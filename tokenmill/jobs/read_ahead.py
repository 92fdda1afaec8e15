"""ReadAhead: a background thread runs an iterator of batches into a bounded queue.

    worker thread:  batches ─► put (blocks while ``max_batches`` wait) ─► queue ─► get()
                    the end ─► get() returns None and ``exhausted`` turns True
                    an exception ─► get() re-raises it, after the batches made before it

At most ``max_batches`` batches wait in the queue and one more is in the worker's hands, so
memory stays bounded however long the input. The worker is a daemon thread: a run that
stops at once (a second SIGTERM) never waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
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
    """Runs ``batches`` on a daemon thread named ``name``, at most ``max_batches`` ahead."""

    def __init__(self, batches: Iterator[T], max_batches: int, name: str) -> None:
        if max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        self._batches = batches
        self._queue: queue.Queue[T | _End] = queue.Queue(maxsize=max_batches)
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
            item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
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
                self._queue.get_nowait()
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
        """Queue ``item`` when there is room; False when closed meanwhile."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False
