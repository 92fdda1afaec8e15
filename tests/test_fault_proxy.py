"""The fault proxy itself: a request whose body the connection cuts short is never
forwarded (a store keeps no truncated object; the proxy must not make moto keep one), a
fault ``armed_by`` a path waits for the first PUT there, and connections made while the
proxy's thread waits are queued, not timed out."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import time

import fsspec
import pytest

from tests.fault_proxy import FaultProxy, FaultyS3, faulty_s3  # noqa: F401
from tests.s3_server import s3_endpoint  # noqa: F401


def test_a_body_cut_short_is_dropped_not_forwarded(faulty_s3: FaultyS3) -> None:  # noqa: F811
    direct = fsspec.filesystem("s3", **faulty_s3.direct)
    direct.mkdir("cut-short")
    host, port = faulty_s3.proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        head = (
            "PUT /cut-short/manifest.json HTTP/1.1\r\n"
            f"Host: {host}:{port}\r\nContent-Length: 100\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"shards": {"a": 1}')  # 19 of the 100 bytes promised
    stats = faulty_s3.proxy.stats
    deadline = time.monotonic() + 5
    while stats["cut_short"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stats["cut_short"] == 1 and stats["forwarded"] == 0, stats
    direct.invalidate_cache()
    assert not direct.exists("cut-short/manifest.json")


def test_an_armed_fault_waits_for_the_put_that_arms_it(faulty_s3: FaultyS3) -> None:  # noqa: F811
    proxy = faulty_s3.proxy
    fs = fsspec.filesystem("s3", **faulty_s3.options(timeout_s=1.0, retries=0))
    fs.mkdir("armed")
    proxy.fail(500, "InternalError", methods=None, armed_by="job.manifest.json")
    try:
        fs.pipe_file("armed/shard-0.jsonl", b"a")  # not the arming path: passes
        fs.pipe_file("armed/job.manifest.json", b"{}")  # passes, and arms the fault
        assert proxy.stats["failed"] == 0, proxy.stats
        with pytest.raises(OSError):
            fs.pipe_file("armed/shard-1.jsonl", b"b")
        assert proxy.stats["failed"] >= 1, proxy.stats
    finally:
        proxy.clear()
    direct = fsspec.filesystem("s3", **faulty_s3.direct)
    direct.invalidate_cache()
    assert direct.cat_file("armed/job.manifest.json") == b"{}"
    assert not direct.exists("armed/shard-1.jsonl")


# Connects a child process makes once told to, each given 1 s (the job's connect timeout).
_BURST = """
import socket, sys
port, opened = int(sys.argv[1]), []
sys.stdin.readline()
for _ in range(20):
    sock = socket.socket()
    sock.settimeout(1.0)
    try:
        sock.connect(("127.0.0.1", port))
        opened.append(sock)
    except OSError:
        pass
print(len(opened))
"""


def test_a_burst_of_connections_waits_for_a_busy_proxy() -> None:
    """The proxy accepts in a thread of the test process, which shares the GIL with an
    in-process job. Here the test holds the GIL (a sort, a second or more) while another
    process opens 20 connections: each is queued until the proxy accepts it. With
    socketserver's backlog of 5, the 7th on timed out after 1 s (its SYN dropped), the
    ConnectTimeoutError test_s3_faults' rerun after the fault cleared met at times."""
    keys = [random.random() for _ in range(4_000_000)]
    with FaultProxy(("127.0.0.1", 9)) as proxy:  # (never forwards: nothing is sent)
        child = subprocess.Popen(
            [sys.executable, "-c", _BURST, str(proxy.port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)  # the child started, waiting for its line
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        sorted(keys)  # holds the GIL throughout: the proxy's accept thread waits
        opened, _ = child.communicate(timeout=60)
    assert int(opened) == 20, f"{20 - int(opened)} of 20 connections timed out"
