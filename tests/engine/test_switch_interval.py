"""short_gil_turns and brief_gil_turns share one process-wide setting, the GIL switch
interval: however their spans nest or overlap, in one thread or several, the interval is
the shortest any open span asks for, and the one found before the first span once the last
ends (each used to put back what it found, so overlapping spans left 20 us or 0.5 ms turns
for the rest of the process)."""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

from tokenmill.engine.short_gil_turns import (
    BRIEF_TURN_S,
    TURN_S,
    brief_gil_turns,
    short_gil_turns,
)

DEFAULT_S = 0.005  # CPython's default switch interval
SPANS: dict[str, tuple[Callable[[], AbstractContextManager[None]], float]] = {
    "short": (short_gil_turns, TURN_S),
    "brief": (brief_gil_turns, BRIEF_TURN_S),
}


@pytest.fixture(autouse=True)
def default_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(DEFAULT_S)
    yield
    sys.setswitchinterval(before)


class _SpanThread:
    """A thread that enters a span and leaves it when told: spans of several threads, in a
    chosen order."""

    def __init__(self, span: Callable[[], AbstractContextManager[None]]) -> None:
        self._steps: queue.Queue[str] = queue.Queue()
        self._done: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(span,), daemon=True)
        self._thread.start()

    def _run(self, span: Callable[[], AbstractContextManager[None]]) -> None:
        self._steps.get()
        with span():
            self._done.put("in")
            self._steps.get()
        self._done.put("out")

    def step(self) -> None:
        self._steps.put("go")
        self._done.get(timeout=10)

    def finish(self) -> None:
        """Leave the span wherever it is (a failed test's threads stay in no span)."""
        while self._thread.is_alive():
            self._steps.put("go")
            self._thread.join(1)


# Two spans, A and B: their enters and exits in each order a pair of spans can take.
ORDERS = ["AB-AB", "AB-BA", "AA-BB"]  # overlapping, nested, one after the other


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kinds", list(itertools.product(SPANS, repeat=2)))
def test_spans_of_two_threads_restore_the_interval_in_any_order(
    kinds: tuple[str, str], order: str
) -> None:
    threads = {name: _SpanThread(SPANS[kind][0]) for name, kind in zip("AB", kinds, strict=True)}
    ceilings = {name: SPANS[kind][1] for name, kind in zip("AB", kinds, strict=True)}
    inside: set[str] = set()
    try:
        for name in order.replace("-", ""):
            threads[name].step()
            inside ^= {name}  # (entered, or left)
            expected = min([DEFAULT_S] + [ceilings[n] for n in inside])
            assert sys.getswitchinterval() == pytest.approx(expected), (name, sorted(inside))
    finally:
        for thread in threads.values():
            thread.finish()
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)


def test_spans_nested_in_one_thread_keep_the_shortest_and_restore_the_original() -> None:
    with brief_gil_turns():
        with short_gil_turns():  # a loop started inside a brief span
            assert sys.getswitchinterval() == pytest.approx(BRIEF_TURN_S)
            with brief_gil_turns():
                assert sys.getswitchinterval() == pytest.approx(BRIEF_TURN_S)
            assert sys.getswitchinterval() == pytest.approx(BRIEF_TURN_S)
        assert sys.getswitchinterval() == pytest.approx(BRIEF_TURN_S)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)


def test_many_threads_mixing_spans_leave_the_interval_as_it_was() -> None:
    start = threading.Barrier(8)

    def churn(worker: int) -> None:
        start.wait()
        for i in range(300):
            with SPANS["short" if (worker + i) % 3 else "brief"][0]():
                with brief_gil_turns():
                    time.sleep(0)  # another thread's turn, inside the span

    workers = [threading.Thread(target=churn, args=(w,)) for w in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)
