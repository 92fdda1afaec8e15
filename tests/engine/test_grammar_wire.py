"""The engine's end of a grammar worker's socket (grammar_wire.py): answers framed as
``multiprocessing.connection.Connection`` frames them, however the bytes arrive."""

from __future__ import annotations

import socket
import struct
import threading
import time
from multiprocessing.connection import Connection

import pytest

from tokenmill.engine.grammar_wire import Link


def _pair() -> tuple[Link, Connection]:
    ours, theirs = socket.socketpair()
    return Link(ours), Connection(theirs.detach())


def test_answers_sent_by_a_connection_come_out_one_by_one_in_order() -> None:
    link, worker = _pair()
    assert not link.ready(0)
    for payload in (b"status", b"", b"x" * 200_000):  # the long one takes several reads
        worker.send_bytes(payload)
    assert link.ready(5)
    assert [link.take(), link.take()] == [b"status", b""]
    assert link.take() == b"x" * 200_000
    assert not link.ready(0)


def test_messages_sent_by_a_link_are_read_by_a_connection() -> None:
    link, worker = _pair()
    for payload in (b"short", b"y" * 100_000):
        link.send(payload)
    assert worker.recv_bytes() == b"short"
    assert worker.recv_bytes() == b"y" * 100_000


def test_a_half_arrived_answer_is_not_ready_until_the_rest_comes() -> None:
    ours, theirs = socket.socketpair()
    link = Link(ours)
    theirs.sendall(struct.pack("!i", 6) + b"abc")
    assert not link.ready(0.05)
    later = threading.Timer(0.05, lambda: theirs.sendall(b"def" + struct.pack("!i", 0)))
    later.start()
    assert link.ready(5)
    later.join()
    assert link.take() == b"abcdef"
    assert link.ready(0) and link.take() == b""


def test_an_answer_trickling_in_is_waited_for_no_longer_than_the_timeout() -> None:
    """A worker that stalls halfway through an answer, a byte now and then: ``ready`` gives
    up after its timeout in all, not after a timeout between bytes."""
    ours, theirs = socket.socketpair()
    link = Link(ours)
    theirs.sendall(struct.pack("!i", 100))
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.02):
            theirs.sendall(b"x")

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    started = time.monotonic()
    assert not link.ready(0.2)
    assert time.monotonic() - started < 1.0
    stop.set()
    sender.join()


def test_a_long_frames_eight_byte_length_is_read() -> None:
    ours, theirs = socket.socketpair()
    link = Link(ours)
    theirs.sendall(struct.pack("!iQ", -1, 3) + b"abc")
    assert link.take() == b"abc"


def test_a_worker_gone_reads_as_ready_and_its_answer_as_eof() -> None:
    link, worker = _pair()
    worker.send_bytes(b"last")
    worker.close()
    assert link.take() == b"last"
    assert link.ready(0)  # gone: nothing more will come
    with pytest.raises(EOFError):
        link.take()
