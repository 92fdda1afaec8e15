"""A fault-injecting HTTP proxy on 127.0.0.1, for putting in front of a local S3 (moto).

    client (s3fs) ──► FaultProxy 127.0.0.1:<port> ──► target (moto) 127.0.0.1:<port>
                        │
                        ├─ fail(...)   answer 503 SlowDown / 500 InternalError instead of
                        │              forwarding (or after forwarding: the write happened but
                        │              the client sees an error), for the next N matching
                        │              requests, a fraction of them, or all of them
                        ├─ hang(...)   hold matching requests longer than any client timeout,
                        │              then drop the connection without forwarding
                        ├─ pause()     close the listening socket and every open connection:
                        │              new connections are refused
                        └─ resume()    listen again on the same port

Faults add up (the first added that matches a request decides); ``clear`` removes them all.

One request at a time per client connection (HTTP/1.1 keep-alive); each forwarded request
opens its own connection to the target. Bodies are read whole (``Content-Length`` or
``Transfer-Encoding: chunked``) and forwarded with a ``Content-Length``; a body cut short
(the connection closed inside it, as ``pause`` does) is dropped, never forwarded, as a store
never keeps a truncated object. ``stats`` counts what happened. Nothing leaves 127.0.0.1:
the target must be a loopback address.

Tests take the ``faulty_s3`` fixture (moto behind a proxy): import it together with
``tests.s3_server.s3_endpoint``, which it builds on.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import pytest

__all__ = ["FaultProxy", "FaultyS3", "faulty_s3"]

# Headers that describe one hop, not the message: never forwarded as they came.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)

_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>{code}</Code><Message>{message}</Message>"
    "<RequestId>fault-proxy</RequestId></Error>"
)
_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
}


@dataclass
class _Fault:
    kind: str  # "error" | "hang"
    methods: frozenset[str] | None  # None: every method
    path_contains: str
    remaining: int | None  # matching requests still to hit; None: no limit
    fraction: float
    status: int = 503
    code: str = "SlowDown"
    after_forward: bool = False
    hang_s: float = 30.0
    armed_by: str | None = None  # inactive until ``arm_puts`` PUTs to a path ending so
    arm_puts: int = 1  # have been forwarded

    def matches(self, method: str, path: str) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        return self.path_contains in path


class FaultProxy:
    """A threaded HTTP proxy to ``target`` (host, port) on loopback, with injectable faults.

    Use as a context manager or call ``start``/``stop``. Thread-safe: faults may be changed
    while requests are in flight. ``url`` is the address to give clients.
    """

    def __init__(self, target: tuple[str, int], seed: int = 0) -> None:
        host, port = target
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"FaultProxy forwards to loopback only, got target host {host!r}")
        self.target = ("127.0.0.1" if host == "localhost" else host, int(port))
        self.stats: Counter[str] = Counter()
        self.port = 0
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._faults: list[_Fault] = []
        self._release = threading.Event()  # set on stop: hung requests give up at once
        self._refusing = threading.Event()  # set while paused
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._listen()
        return self

    def stop(self) -> None:
        self._release.set()
        self._close_server()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pause(self) -> None:
        """Refuse connections: stop listening and cut every open connection (and any accepted
        while the listener shuts down)."""
        self._refusing.set()
        self._close_server()
        self.count("pauses")

    def resume(self) -> None:
        """Listen again on the same port."""
        if self._server is None:
            self._refusing.clear()
            self._listen()

    @property
    def paused(self) -> bool:
        return self._refusing.is_set()

    # -- faults --------------------------------------------------------------------------

    def fail(
        self,
        status: int = 503,
        code: str = "SlowDown",
        count: int | None = None,
        fraction: float = 1.0,
        methods: tuple[str, ...] | None = ("PUT",),
        path_contains: str = "",
        after_forward: bool = False,
        armed_by: str | None = None,
        armed_after: int = 1,
    ) -> None:
        """Add a fault: answer ``status`` with S3 error ``code`` to matching requests, the
        next ``count`` of them (None: all), each with probability ``fraction`` (seeded). With
        ``after_forward`` the request reaches the target first, so the write happens but the
        client sees an error. With ``armed_by`` the fault waits until ``armed_after`` PUTs to a
        path ending in it have been forwarded (``<job>.manifest.d/00000000.json``, the
        manifest record of a job's first commit: "from its first commit on"), counted in the
        proxy, so no test thread races the job. Faults added earlier are asked first."""
        self._add(
            _Fault(
                "error",
                None if methods is None else frozenset(methods),
                path_contains,
                count,
                fraction,
                status=status,
                code=code,
                after_forward=after_forward,
                armed_by=armed_by,
                arm_puts=armed_after,
            )
        )

    def hang(
        self,
        seconds: float = 30.0,
        count: int | None = None,
        methods: tuple[str, ...] | None = None,
        path_contains: str = "",
    ) -> None:
        """Add a fault: hold matching requests for ``seconds`` (or until ``stop``), then drop
        their connection unanswered; the target never sees them."""
        self._add(
            _Fault(
                "hang",
                None if methods is None else frozenset(methods),
                path_contains,
                count,
                1.0,
                hang_s=seconds,
            )
        )

    def clear(self) -> None:
        """Remove every fault (a paused proxy stays paused: call ``resume``). Requests
        already held by ``hang`` stay held."""
        with self._lock:
            self._faults.clear()

    def _add(self, fault: _Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def count(self, name: str) -> None:
        with self._lock:
            self.stats[name] += 1

    def _decide(self, method: str, path: str) -> _Fault | None:
        """The first fault that hits this request, if any (counts it against ``count``)."""
        with self._lock:
            for fault in self._faults:
                if fault.armed_by is not None or not fault.matches(method, path):
                    continue
                if fault.remaining is not None and fault.remaining <= 0:
                    continue
                if fault.fraction < 1.0 and self._rng.random() >= fault.fraction:
                    continue
                if fault.remaining is not None:
                    fault.remaining -= 1
                return fault
            return None

    def _arm(self, method: str, path: str) -> None:
        """A request was forwarded: arm the faults waiting for a PUT to this path."""
        if method != "PUT":
            return
        path = path.split("?", 1)[0]
        with self._lock:
            for fault in self._faults:
                if fault.armed_by is not None and path.endswith(fault.armed_by):
                    fault.arm_puts -= 1
                    if fault.arm_puts <= 0:
                        fault.armed_by = None

    # -- serving -------------------------------------------------------------------------

    def _listen(self) -> None:
        server = _Server(("127.0.0.1", self.port), _Handler)
        server.proxy = self
        self.port = server.server_address[1]
        self._server = server
        # A short poll interval: ``pause`` takes effect within 20 ms.
        self._thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
        self._thread.start()

    def _close_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # The listen backlog (socketserver's default: 5). The proxy accepts in a thread of the
    # test process, which shares the GIL with an in-process job; a burst of connections
    # past a backlog of 5 while it waited had its SYNs dropped, retried by the kernel after
    # 1 s, past the 1 s connect timeout: a ConnectTimeoutError no fault was injected for
    # (test_s3_faults' rerun after the fault cleared exited 75). Queued, a connection is
    # only as late as its request, which the read timeout and s3fs's retries cover.
    request_queue_size = 128
    proxy: FaultProxy

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A connection cut by ``pause`` or by the client's timeout: expected, not a traceback.
        self.proxy.count("connection_errors")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like a real S3 endpoint

    def setup(self) -> None:
        super().setup()
        self.proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]  # a _Server
        self.proxy._track(self.connection, True)

    def finish(self) -> None:
        self.proxy._track(self.connection, False)
        try:
            super().finish()
        except OSError:
            pass

    def handle(self) -> None:
        if self.proxy._refusing.is_set():
            return  # accepted while the proxy was pausing: cut, as if refused
        super().handle()

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: tests read ``stats``

    def do_GET(self) -> None:
        self._handle()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _handle(self) -> None:
        proxy = self.proxy
        body = self._read_body()
        if body is None:  # the client's connection ended inside the body (pause(), say)
            proxy.count("cut_short")
            self.close_connection = True
            return  # as a store does: an incomplete request is never acted on
        proxy.count("requests")
        proxy.count(f"requests_{self.command}")
        fault = proxy._decide(self.command, self.path)
        if fault is not None and fault.kind == "hang":
            proxy.count("hung")
            proxy._release.wait(fault.hang_s)
            self.close_connection = True
            return
        if fault is not None and not fault.after_forward:
            proxy.count("failed")
            self._send_error(fault)
            return
        status, reason, headers, payload = self._forward(body)
        proxy.count("forwarded")
        if status < 300:
            proxy._arm(self.command, self.path)
        if fault is not None:
            proxy.count("failed_after_forward")
            self._send_error(fault)
            return
        self.send_response_only(status, reason)
        for name, value in headers:
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        if self.command == "HEAD":  # a HEAD answer names the size of the body it leaves out
            length = next((v for n, v in headers if n.lower() == "content-length"), "0")
            self.send_header("Content-Length", length)
        else:
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _read_body(self) -> bytes | None:
        """The request's whole body, or None when the connection ended before it did (a
        short read: forwarding it would store a truncated object, which no store does)."""
        try:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return b"".join(chunks)
                    chunk = self.rfile.read(size)
                    if len(chunk) < size:
                        return None
                    chunks.append(chunk)
                    self.rfile.readline()  # the CRLF after each chunk
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
        except (OSError, ValueError):  # reset mid-body, or a chunk size line cut off
            return None
        return body if len(body) == length else None

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers.pop("Content-Length", None)
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(*self.proxy.target, timeout=60)
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
            return resp.status, resp.reason, resp.getheaders(), payload
        finally:
            conn.close()

    def _send_error(self, fault: _Fault) -> None:
        payload = b""
        if self.command != "HEAD":
            message = _MESSAGES.get(fault.code, "Injected by FaultProxy.")
            payload = _ERROR_XML.format(code=fault.code, message=message).encode()
        self.send_response_only(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("x-amz-request-id", "fault-proxy")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


# -- for tests: moto's S3 behind the proxy -----------------------------------------------------


@dataclass(frozen=True)
class FaultyS3:
    """moto's S3 (``direct`` storage options, to check what was written) behind ``proxy``
    (``options()``: what a job gets, with small client timeouts so that faults cost seconds)."""

    proxy: FaultProxy
    direct: dict[str, Any]

    def options(
        self, timeout_s: float = 1.0, retries: int = 1, read_timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Storage options through the proxy. botocore (standard mode) retries a failed
        request up to ``retries`` times after the first attempt, backing off up to 2**n s;
        s3fs retries some errors (SlowDown, timeouts, dropped connections) on top of that."""
        return {
            **self.direct,
            "endpoint_url": self.proxy.url,
            "config_kwargs": {
                "connect_timeout": timeout_s,
                "read_timeout": timeout_s if read_timeout_s is None else read_timeout_s,
                "retries": {"max_attempts": retries, "mode": "standard"},
            },
        }


@pytest.fixture
def faulty_s3(s3_endpoint: tuple[str, dict[str, Any]]) -> Iterator[FaultyS3]:
    """A fresh moto S3 (``tests.s3_server.s3_endpoint``; import both fixtures) behind a
    FaultProxy; the proxy is stopped (hung requests released) after the test."""
    endpoint, options = s3_endpoint
    where = urlsplit(endpoint)
    with FaultProxy((where.hostname or "", where.port or 0)) as proxy:
        yield FaultyS3(proxy, dict(options))
