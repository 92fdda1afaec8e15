"""SIGTERM, SIGINT and SIGHUP stop a run at its next commit boundary, not in the middle of
nowhere.

    1st signal ─► cancel.set(): in-flight rows are dropped, complete shards are committed,
                  the report says "cancelled", run-job exits 75 (rerun to resume)
    2nd signal ─► JobInterrupted raised at once (as safe as SIGKILL: every write is atomic)

SIGTERM is what Airflow, Kubernetes and systemd send before they kill; SIGINT is Ctrl-C;
SIGHUP is a closed terminal or a dropped ssh session (it killed the run: exit 129, no message,
no report; an audit), left alone where it is ignored (``nohup run-job ...``).
Handlers can only be installed from the main thread; elsewhere this does nothing.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

log = logging.getLogger("tokenmill.jobs")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_held: list[int] = []  # stop signals that came before a StopOnSignals opened (hold_signals)


def _taken(sig: int) -> bool:
    """Whether a stop handler goes on ``sig``: not on a SIGHUP that is ignored (``nohup``),
    which would make a closed terminal stop the run that nohup keeps going."""
    return sig != signal.SIGHUP or signal.getsignal(sig) != signal.SIG_IGN


def hold_signals() -> None:
    """Hold SIGTERM, SIGINT and SIGHUP until a ``StopOnSignals`` opens, which then takes the first
    one held as its own: the ``run-job`` command calls this first thing, so a stop that
    comes while its modules import (up to a second) exits 75 as any stop does, instead of
    killing the process. Main thread only."""
    if threading.current_thread() is threading.main_thread():
        for sig in filter(_taken, STOP_SIGNALS):
            signal.signal(sig, lambda signum, frame: _held.append(signum))


class JobInterrupted(BaseException):
    """A second stop signal arrived: the run ends now, without waiting for a commit. A
    BaseException, as KeyboardInterrupt: no handler of a row's or a step's errors may take it
    for one (a row once became an error row for it, committed)."""


class StopOnSignals:
    """Context manager: while open, SIGTERM/SIGINT set ``cancel`` (and a second one raises
    JobInterrupted). ``received`` names the first signal, or is None."""

    def __init__(self, cancel: threading.Event) -> None:
        self.cancel = cancel
        self.received: str | None = None
        self.again = False  # a second signal came: the run was cut short, threads at work
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in filter(_taken, STOP_SIGNALS):
                self._previous[sig] = signal.signal(sig, self._handle)
            if _held:  # a stop while run-job started (hold_signals): one stop, now
                self._handle(_held[0], None)
                _held.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            self.again = True
            raise JobInterrupted(f"{name} received again: stopping now")
        self.received = name
        self.cancel.set()
        log.warning(
            "%s received: stopping at the next commit boundary (send it again to stop at once)",
            name,
        )


@contextmanager
def stop_handlers_kept() -> Iterator[None]:
    """Put SIGTERM's and SIGINT's handlers back after the block: ``ray.init`` installs its
    own, under which a SIGTERM ended the job at once (exit 1) instead of at a commit
    boundary. A signal that reaches ``ray.init``'s handler inside the block (it exits
    with the signal's number) raises JobInterrupted: run-job said nothing and exited 15."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    except SystemExit as exc:
        # (ray.init's handlers are SIGTERM's and SIGINT's; an exit 1 is not a SIGHUP)
        if exc.code not in (int(signal.SIGTERM), int(signal.SIGINT)):
            raise
        name = signal.Signals(exc.code).name  # type: ignore[arg-type]
        raise JobInterrupted(f"{name} received while Ray started: stopping now") from None
    finally:
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)


@contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold SIGTERM and SIGINT back during the block, then put their handlers back and let
    one that came meanwhile reach them: ``ray.shutdown`` resets both to the system's default
    below Python (``signal.getsignal`` still names the handler), so a signal during or after
    it killed run-job (exit 143: no message, no report; a job whose every shard was
    committed was left not complete). Main thread only; elsewhere the block just runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        with stop_handlers_kept():
            yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
