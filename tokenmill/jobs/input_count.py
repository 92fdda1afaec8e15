"""The input's row total for a run's progress, counted on its own thread beside the run.

    runner ── InputCount.start(count, cfg) ──► thread: count(cfg, stop) ──► progress.set_total
       │                                                    ▲
       └── run ends (or is cancelled) ── stop() ────────────┘ (the count ends with the run)

A local run's first row never waits for its count: counting every row of a large JSONL input
took as long as a download of it (26 s for 5,000 files on S3), all before the first row. The
progress shows rows done and the rate until the total comes, then the total and an ETA.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from tokenmill.io.readers import InputConfig
from tokenmill.jobs.row_estimate import RowTotal

if TYPE_CHECKING:
    from tokenmill.jobs.progress import Progress

__all__ = ["InputCount"]

log = logging.getLogger("tokenmill.jobs")

Count = Callable[[InputConfig, threading.Event], "RowTotal | None"]


class InputCount:
    """A row total being counted (``start``) or already known (``known``)."""

    def __init__(self, counted: Future[RowTotal | None], stop: threading.Event) -> None:
        self._counted = counted
        self._stop = stop

    @classmethod
    def start(cls, count: Count, cfg: InputConfig) -> InputCount:
        """``count(cfg, stop)`` on a thread of its own, from now on."""
        stop = threading.Event()
        pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-count")
        try:
            return cls(pool.submit(count, cfg, stop), stop)
        finally:
            pool.shutdown(wait=False)  # (the thread ends with the count)

    @classmethod
    def known(cls, total: RowTotal | None) -> InputCount:
        """A total counted already (a Ray run counts before it starts: its chunks' size)."""
        counted: Future[RowTotal | None] = Future()
        counted.set_result(total)
        return cls(counted, threading.Event())

    def show_in(self, progress: Progress) -> None:
        """Give ``progress`` the total once counted (at once if it is), from the count's
        thread."""
        self._counted.add_done_callback(lambda done: _give(done, progress))

    def stop(self) -> None:
        """Stop the count (it stops between files and every 65,536 lines): the run has ended,
        and the process would otherwise wait for the rest of the input to be read."""
        self._stop.set()


def _give(done: Future[RowTotal | None], progress: Progress) -> None:
    if done.cancelled() or done.exception() is not None:
        log.debug("could not count input rows: %s", done.exception())
        return
    progress.set_total(done.result())
