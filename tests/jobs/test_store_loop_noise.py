"""asyncio's report of a store request's connection error nobody awaited any more: one
WARNING line, no traceback (store_loop_noise.py); other asyncio records untouched."""

from __future__ import annotations

import asyncio
import gc
import io
import logging

import aiohttp
import pytest

from tokenmill.jobs.store_loop_noise import quiet_store_loop_errors


@pytest.fixture
def asyncio_log() -> io.StringIO:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    quiet_store_loop_errors()
    quiet_store_loop_errors()  # idempotent
    yield stream
    logger.removeHandler(handler)


def _unretrieved(exc: BaseException) -> None:
    """A task that raises ``exc`` and is dropped unawaited: asyncio logs it when collected."""

    async def fail() -> None:
        raise exc

    loop = asyncio.new_event_loop()
    task = loop.create_task(fail())
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    del task
    gc.collect()


@pytest.mark.parametrize(
    "exc",
    [
        aiohttp.client_exceptions.ClientConnectionResetError("Cannot write to closing transport"),
        ConnectionResetError("peer reset"),
    ],
)
def test_a_connection_error_nobody_awaited_is_one_line(asyncio_log: io.StringIO, exc) -> None:
    _unretrieved(exc)
    text = asyncio_log.getvalue()
    assert "Traceback" not in text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("WARNING Task exception was never retrieved")
    assert type(exc).__name__ in lines[0] and str(exc) in lines[0]


def test_other_errors_keep_their_traceback(asyncio_log: io.StringIO) -> None:
    _unretrieved(ValueError("a bug"))
    text = asyncio_log.getvalue()
    assert "ERROR Task exception was never retrieved" in text and "Traceback" in text
