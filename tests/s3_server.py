"""A local S3 for tests: moto's threaded server on 127.0.0.1, reached through s3fs.

Import the fixture into a test module (``from tests.s3_server import s3_endpoint``) and take
``s3_endpoint``: it yields ``(endpoint_url, storage_options)``, where storage_options are what
``fsspec``/``s3fs`` need (``InputConfig.storage_options``). Each test gets a fresh, empty S3.
``count_fetched`` counts the bytes s3fs downloads from it.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("moto.server", reason="needs moto[server] (pip install 'moto[server]')")
pytest.importorskip("s3fs", reason="needs s3fs")

from moto.server import ThreadedMotoServer  # noqa: E402
from werkzeug.serving import make_server  # noqa: E402

try:  # moto's internals, for the faster stop below; without them, moto's own server
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
except ImportError:
    DomainDispatcherApplication = None

_FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class _MotoServer(ThreadedMotoServer):
    """moto's ThreadedMotoServer, its serving loop checking for ``stop`` every 20 ms: at
    werkzeug's default of 0.5 s, each test's ``stop`` waited up to that long."""

    def _server_entry(self) -> None:  # ThreadedMotoServer's, but for the poll interval
        # A moto whose internals moved runs its own loop (a failure here would leave
        # ``start`` waiting forever for the ready event).
        try:
            if DomainDispatcherApplication is None:
                raise AttributeError("moto's werkzeug app moved")
            address, port, ready = self._ip_address, self._port, self._server_ready_event
        except AttributeError:
            super()._server_entry()
            return
        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(address, port, app, True, request_handler=MotoRequestHandler)
        ready.set()
        self._server.serve_forever(poll_interval=0.02)


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(endpoint_url, storage_options)`` of a moto S3 server on 127.0.0.1 (free port)."""
    for name, value in _FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    # Never fall back to a real credential chain or the instance metadata service.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    server = _MotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint_url = f"http://{host}:{port}"
        # moto keeps its state per process: start every test from an empty S3.
        reset = urllib.request.Request(f"{endpoint_url}/moto-api/reset", method="POST")
        urllib.request.urlopen(reset, timeout=10).close()
        storage_options: dict[str, Any] = {
            "endpoint_url": endpoint_url,
            "key": "testing",
            "secret": "testing",
            # A fresh filesystem object per test: no listing cached from another server.
            "skip_instance_cache": True,
        }
        yield endpoint_url, storage_options
    finally:
        server.stop()


def count_fetched(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every object read s3fs makes from now on (until ``monkeypatch`` is undone),
    one entry a request: ranged reads of an open file and ``cat_file`` reads alike."""
    import s3fs.core

    fetched: list[int] = []
    cat, fetch_range = s3fs.core.S3FileSystem._cat_file, s3fs.core._fetch_range

    async def counting_cat(self: Any, path: str, *args: Any, **kwargs: Any) -> bytes:
        data = await cat(self, path, *args, **kwargs)
        fetched.append(len(data))
        return data

    def counting_fetch_range(*args: Any, **kwargs: Any) -> bytes:
        data = fetch_range(*args, **kwargs)
        fetched.append(len(data))
        return data

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_cat_file", counting_cat)
    monkeypatch.setattr(s3fs.core, "_fetch_range", counting_fetch_range)
    return fetched
