"""ReadAhead: a worker thread runs ahead of its consumer by a bounded number of batches, and
its errors reach the consumer in order, never lost and never hanging it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tokenmill.jobs.read_ahead import ReadAhead


class _Counted:
    """Batches of one int, counting how many the worker has made."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.made = 0
        self.closed = False
        self.n, self.fail_at = n, fail_at

    def batches(self) -> Iterator[list[int]]:
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise OSError(f"input unreadable at batch {i}")
                self.made += 1
                yield [i]
        finally:
            self.closed = True


def _wait_until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_worker_stays_within_the_bound_and_everything_arrives_in_order() -> None:
    source = _Counted(100_000)
    ahead = ReadAhead(source.batches(), max_batches=4, name="test-reader")
    got: list[int] = []
    try:
        while not ahead.exhausted:
            # queue full (4) + the one the worker holds while it waits for room
            assert source.made - len(got) <= 4 + 1
            if len(got) % 10_000 == 0:  # now and then let the worker run as far as it may
                _wait_until(lambda: ahead._queue.full() or source.made == source.n)
                assert source.made - len(got) <= 4 + 1
            batch = ahead.get(timeout=1.0)
            if batch is not None:
                got.extend(batch)
    finally:
        ahead.close()
    assert got == list(range(100_000)) and source.closed


def test_an_error_comes_after_the_batches_before_it_and_only_once() -> None:
    source = _Counted(10, fail_at=3)
    ahead = ReadAhead(source.batches(), max_batches=2, name="test-reader")
    got = []
    with pytest.raises(OSError, match="batch 3"):
        while True:
            batch = ahead.get(timeout=1.0)
            if batch is not None:
                got.extend(batch)
    assert got == [0, 1, 2] and ahead.exhausted
    assert ahead.get(timeout=0.1) is None  # raised once; then the end
    ahead.close()


def test_close_stops_a_worker_blocked_on_a_full_queue() -> None:
    source = _Counted(1_000_000)
    ahead = ReadAhead(source.batches(), max_batches=1, name="test-reader")
    _wait_until(lambda: source.made == 2)  # one queued, one in hand, blocked
    ahead.close(timeout=5)
    assert not ahead._thread.is_alive() and source.closed and source.made == 2
    assert ahead.get(timeout=0.1) is None


def test_a_slow_consumer_can_be_interrupted_while_it_waits() -> None:
    """``get`` waits in slices: nothing keeps the consumer's thread blocked for long."""
    release = threading.Event()

    def slow() -> Iterator[list[int]]:
        release.wait(10)
        yield [1]

    ahead = ReadAhead(slow(), max_batches=1, name="test-reader")
    start = time.monotonic()
    assert ahead.get(timeout=0.05) is None and not ahead.exhausted
    assert time.monotonic() - start < 2
    release.set()
    _wait_until(lambda: ahead._queue.qsize() == 1)
    assert ahead.get(timeout=0.0) == [1]
    ahead.close()


def test_max_batches_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_batches"):
        ReadAhead(iter([]), max_batches=0, name="x")


def test_with_size_of_the_queued_batches_stay_within_max_bytes_but_one_always_passes() -> None:
    """A count of batches bounds nothing when batches can be any size (wide rows); with
    ``size_of`` the batches waiting hold ``max_bytes`` at most, and a batch larger than
    that alone still passes (when the queue is empty)."""
    sizes = [3, 4, 2, 50, 1, 5, 5, 5, 9, 1] * 20
    made = [0]

    def batches() -> Iterator[list[int]]:
        for i, n in enumerate(sizes):
            made[0] += 1
            yield [i] * n

    ahead = ReadAhead(batches(), max_batches=100, name="test-reader", size_of=len, max_bytes=10)
    got: list[list[int]] = []
    try:
        while not ahead.exhausted:
            _wait_until(lambda: made[0] == len(sizes) or ahead.queued_bytes > 0)
            time.sleep(0.01)  # the worker as far ahead as it may get
            queued = ahead.queued_bytes
            assert queued <= 10 or ahead._queue.qsize() == 1, queued
            batch = ahead.get(timeout=1.0)
            if batch is not None:
                got.append(batch)
    finally:
        ahead.close()
    assert [len(b) for b in got] == sizes and [b[0] for b in got] == list(range(len(sizes)))
    assert ahead.queued_bytes == 0
