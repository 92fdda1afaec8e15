"""The engine's end of a socket to a grammar worker process (grammar_processes.py).

Messages are framed as ``multiprocessing.connection.Connection`` frames them (a 4-byte
big-endian signed length, or -1 and an 8-byte length for the rare message over 2 GiB, then
the bytes), so the worker reads them with a plain ``Connection``. The engine's end reads
differently: a step leaves two answers from each worker (a fill's follows its tokens'
statuses), and ``Connection`` reads every answer with a poll and two reads of its own
(header, then body). ``Link`` reads whatever the socket holds in one call into a buffer and
takes the answers out of it, so a worker's second answer, when it is in by the time the
first is read, costs no system call at all.
"""

from __future__ import annotations

import select
import socket
import struct
import time

__all__ = ["Link"]

_READ = 1 << 16
_ONE_WRITE = 1 << 16  # shorter messages go out with their header in one write (a copy)
_LONG = 0x7FFFFFFF  # longer payloads: a -1 length, then the length as 8 bytes
_LONG_MARK = b"\xff\xff\xff\xff"


class Link:
    """One worker's socket, seen from the engine: ``send`` a message, ``ready`` /
    ``take`` its answers in order. A worker gone (its end closed) reads as ready, and
    ``take`` then raises EOFError."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self._eof = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, payload: bytes) -> None:
        """Send one message (raises OSError when the worker is gone)."""
        size = len(payload)
        if size > _LONG:
            header = struct.pack("!iQ", -1, size)
        else:
            header = struct.pack("!i", size)
        if size < _ONE_WRITE:  # one system call for a step of up to ~2,000 rows
            self._sock.sendall(header + payload)
        else:
            self._sock.sendall(header)
            self._sock.sendall(payload)

    def ready(self, timeout_s: float | None) -> bool:
        """Whether an answer is in (or the worker is gone), waiting up to ``timeout_s``
        for it (None: as long as it takes; 0: not at all)."""
        return self._wait(timeout_s) is not None or self._eof

    def take(self) -> bytes:
        """The next answer, waiting for it if it is not in yet. Raises EOFError when the
        worker is gone before answering."""
        end = self._wait(None)
        if end is None:
            raise EOFError("the grammar worker's socket closed")
        start = 12 if self._buffer[:4] == _LONG_MARK else 4
        answer = bytes(self._buffer[start:end])
        del self._buffer[:end]
        return answer

    def close(self) -> None:
        self._sock.close()

    def _wait(self, timeout_s: float | None) -> int | None:
        """Where the first whole answer in the buffer ends, reading the socket for up to
        ``timeout_s`` in all while there is none; None if none came whole in that time (or
        the worker is gone)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            end = self._frame_end()
            if end is not None or self._eof:
                return end
            left = None if deadline is None else max(0.0, deadline - time.monotonic()) * 1e3
            if not self._poller.poll(left):
                return None
            try:
                chunk = self._sock.recv(_READ)
            except ConnectionResetError:
                chunk = b""
            self._eof = not chunk
            self._buffer += chunk

    def _frame_end(self) -> int | None:
        """Where the first whole answer in the buffer ends, or None while none is whole."""
        buffer = self._buffer
        if len(buffer) < 4:
            return None
        size = int.from_bytes(buffer[:4], "big", signed=True)
        start = 4
        if size == -1:
            if len(buffer) < 12:
                return None
            size, start = int.from_bytes(buffer[4:12], "big"), 12
        end = start + size
        return end if len(buffer) >= end else None
