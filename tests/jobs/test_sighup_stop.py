"""SIGHUP (a closed terminal, a dropped ssh session) stops a run as SIGTERM does, at the next
commit boundary with exit 75: it killed run-job (exit 129, no message, no report). Where it
is ignored (``nohup run-job ...``) it stays ignored."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from tokenmill.jobs.stop_signals import StopOnSignals


@pytest.fixture
def sighup_kept() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGHUP)
    yield
    signal.signal(signal.SIGHUP, previous)


def test_sighup_stops_at_the_next_commit_boundary(sighup_kept: None) -> None:
    # (a handler of the test's stands for the default, which would end pytest without the
    # fix; set whatever pytest had, SIG_IGN under nohup included)
    before: list[int] = []
    signal.signal(signal.SIGHUP, lambda signum, frame: before.append(signum))
    handler = signal.getsignal(signal.SIGHUP)
    cancel = threading.Event()
    with StopOnSignals(cancel) as stop:
        os.kill(os.getpid(), signal.SIGHUP)
        assert cancel.wait(1), "SIGHUP did not stop the run"
    assert stop.received == "SIGHUP" and not before
    assert signal.getsignal(signal.SIGHUP) is handler  # put back


def test_an_ignored_sighup_stays_ignored(sighup_kept: None) -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup run-job ...
    cancel = threading.Event()
    with StopOnSignals(cancel) as stop:
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGHUP)
    assert not cancel.is_set() and stop.received is None
