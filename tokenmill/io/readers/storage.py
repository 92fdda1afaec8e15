"""Opening input URLs through fsspec: local paths, ``s3://``, ``gs://``, ``az://``, ..."""

from __future__ import annotations

import os
import re
from typing import Any

import fsspec
from fsspec.core import split_protocol, url_to_fs

from tokenmill.io.storage import StorageError, builtin_error


def resolve(url: str, storage_options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for ``url`` and the path inside it (``~`` expanded for local paths)."""
    if split_protocol(url)[0] is None:
        url = os.path.expanduser(url)
    return url_to_fs(url, **storage_options)


_CHAIN_HEAD = re.compile(r"[a-z][a-z0-9+.-]*")  # fsspec's "simplecache::s3://..." chaining
S3_VERSION_MARK = "?versionId="  # s3fs reads it in a key as an object version


def location_problem(url: str) -> str | None:
    """Why fsspec would not open ``url`` as the file or folder it names, or None: ``::`` that
    is not a chain of filesystems (fsspec cuts ``/a/results::v2`` to ``/a/results``, and
    another folder is read or written), a ``file://`` URL naming a host (``localhost``) or a
    relative path, which fsspec puts under the working directory, or ``?versionId=`` in an
    S3 key."""
    head, sep, rest = url.partition("::")
    # A chain names a filesystem fsspec knows, then the URL or absolute local path it wraps
    # ("simplecache::s3://...", "simplecache::/data/in.jsonl", taken before '::' was checked);
    # a relative name such as ``out::v2`` looks like a chain head, but fsspec then writes
    # to ``out``, or opens a data: URI for ``data::v2``.
    chained = (
        _CHAIN_HEAD.fullmatch(head) is not None
        and head in fsspec.available_protocols()
        and ("://" in rest or "::" in rest or rest.startswith("/"))
    )
    if sep and not chained:
        return (
            f"{url!r} holds '::', which fsspec reads as a chain of filesystems (it would use "
            f"{head!r}); rename the file or folder (a chain is <protocol>::<url>, as in "
            "simplecache::s3://bucket/key)"
        )
    protocol, rest = split_protocol(url)
    host = rest.split("/", 1)[0]  # (rest: after "://"; credentials are refused elsewhere)
    if protocol in ("file", "local") and not rest.startswith("/") and "@" not in host:
        return (
            f"{url!r} names a host or a relative path after {protocol}://, which fsspec "
            "reads as a folder under the working directory; write an absolute path "
            "(/data/x, or file:///data/x with three slashes)"
        )
    if protocol in ("s3", "s3a") and S3_VERSION_MARK in url:
        return (
            f"{url!r} holds {S3_VERSION_MARK!r}, which s3fs reads as an object version, not "
            "part of the key; choose another name"
        )
    return None


def protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    """The names a filesystem answers to (``("s3", "s3a")``; fsspec gives one or several)."""
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def relative_note(path: str) -> str:
    """For a relative local path, what it was looked for as: `` (looked for /abs/path:
    relative paths resolve against the working directory, /cwd)``; else ''. A cron job or an
    Airflow worker runs in another directory than the one a job was tried in, and a message
    naming only ``data/in.jsonl`` does not say where it was looked for."""
    if has_protocol(path) or os.path.isabs(os.path.expanduser(path)):
        return ""
    cwd = os.getcwd()
    return (
        f" (looked for {os.path.join(cwd, path)!r}: relative paths resolve against the "
        f"working directory, {cwd!r}, not the job file's folder)"
    )


# Object-store client packages: an exception of theirs met reading a file is the store's
# failure (botocore's EndpointConnectionError is no OSError), not a bug of the reader's.
STORE_CLIENTS = frozenset(
    {"botocore", "aiobotocore", "aiohttp", "urllib3", "s3fs", "gcsfs", "adlfs", "azure"}
)


def is_read_error(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a read of an input file, is the read's own failure: an
    OSError (the disk's, s3fs's) or any exception type of an object-store client."""
    return isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in STORE_CLIENTS


def read_failed(url: str, exc: BaseException) -> OSError:
    """``exc``, a failed read of input file ``url`` (``is_read_error``), as an OSError that
    names the file (``exc`` itself where it is one and does already): s3fs's errors name no
    object ("[Errno 16] Please reduce your request rate.", botocore's "Connect timeout on
    endpoint URL: ..."), and run-job's message then said which store failed but not what
    it was reading. An OSError keeps its type where it can be built from a message, else
    becomes the builtin one it is (a missing file is still FileNotFoundError, exit 2); any
    other error (a store client's own, botocore's timeouts, whose types take keywords only)
    becomes a StorageError, a storage failure a rerun gets past (exit 75)."""
    if isinstance(exc, OSError) and url in str(exc):
        return exc
    if isinstance(exc, OSError):
        what = f"{url}: reading failed ({exc.strerror or exc})"
        try:
            return type(exc)(what) if exc.errno is None else type(exc)(exc.errno, what)
        except Exception:  # a client's OSError subclass: botocore's take keywords only
            return builtin_error(exc, f"{url}: reading failed ({type(exc).__name__}: {exc})")
    return StorageError(f"{url}: reading failed ({type(exc).__name__}: {exc})")


def has_protocol(url: str) -> bool:
    return split_protocol(url)[0] is not None
