"""The fault proxy itself: a request whose body the connection cuts short is never
forwarded (a store keeps no truncated object; the proxy must not make moto keep one), and a
fault ``armed_by`` a path waits for the first PUT there."""

from __future__ import annotations

import socket
import time

import fsspec
import pytest

from tests.fault_proxy import FaultyS3, faulty_s3  # noqa: F401
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
