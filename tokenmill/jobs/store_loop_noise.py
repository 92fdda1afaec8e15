"""One line, not a traceback, for a store request that failed on the store client's own event
loop after the job had moved on.

fsspec's async clients (s3fs, gcsfs, adlfs, through aiohttp) run requests on an asyncio loop
of their own. When the object store goes away mid-request, the job sees the failure once, as
a storage error (exit 75, "rerun the same command to resume"); but a request task whose
error nobody awaited any more is also reported by asyncio itself at garbage collection, as
"Task exception was never retrieved" with a full traceback on stderr. That second report
says nothing new and reads like a crash. ``quiet_store_loop_errors`` turns such records into
one WARNING line naming the error; other asyncio records are left alone.
"""

from __future__ import annotations

import logging

__all__ = ["quiet_store_loop_errors"]


class _ConnectionErrorsInOneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or not _is_connection_error(exc):
            return True
        first = record.getMessage().splitlines()[0]
        what = "a store request the job no longer awaited"
        record.msg = f"{first}: {type(exc).__name__}: {exc} ({what})"
        record.args = ()
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _is_connection_error(exc: BaseException) -> bool:
    """OSError (ConnectionResetError, aiohttp's ClientConnectionResetError, ...) or one of
    aiohttp's connection errors."""
    if isinstance(exc, OSError):
        return True
    names = {f"{c.__module__}.{c.__name__}" for c in type(exc).__mro__}
    return any(n.startswith("aiohttp.") and "ClientConnectionError" in n for n in names)


_FILTER = _ConnectionErrorsInOneLine()


def quiet_store_loop_errors() -> None:
    """Install the filter on the ``asyncio`` logger (once; idempotent)."""
    logger = logging.getLogger("asyncio")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
