"""Opening input URLs through fsspec: local paths, ``s3://``, ``gs://``, ``az://``, ..."""

from __future__ import annotations

import os
from typing import Any

import fsspec
from fsspec.core import split_protocol, url_to_fs


def resolve(url: str, storage_options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for ``url`` and the path inside it (``~`` expanded for local paths)."""
    if split_protocol(url)[0] is None:
        url = os.path.expanduser(url)
    return url_to_fs(url, **storage_options)


def has_protocol(url: str) -> bool:
    return split_protocol(url)[0] is not None
