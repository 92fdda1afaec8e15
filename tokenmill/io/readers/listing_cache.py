"""What a filesystem client remembers of its listings, forgotten where a run must see the
store as it is now.

fsspec's object-store clients (s3fs, gcsfs, adlfs) keep every listing they make, sizes and
versions (ETags) included, for as long as the process lives, and one client serves every
job a process runs with the same storage options (``submit()`` in a long-lived process).
Taken from that cache, a file rewritten since has its old size and version, and s3fs,
which sends the version it knows with each read, fails to read it at all ("FileExpired";
a rerun that was to start afresh stopped there). So a run lists its input from a client
that has forgotten (``forget_listings``), and the check at its end lists again
(``list_again``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tokenmill.io.readers.storage import protocols, resolve

__all__ = ["forget_listings", "list_again"]

# Input files in one folder past which the folder is listed again rather than each file
# asked about: one listing request gives 1,000 files' sizes and versions, where a file
# asked about costs two requests (its info, and its open's).
LIST_FOLDER_PAST = 16


def forget_listings(url: str, storage_options: dict[str, Any]) -> None:
    """Forget everything the client of ``url`` cached: a path's own entry would leave the
    entries of the folders below it (a glob's, a partitioned folder's) as they were."""
    fs, _ = resolve(url, storage_options)
    fs.invalidate_cache()


def list_again(files: list[str], storage_options: dict[str, Any], stores: set[str]) -> None:
    """Forget the clients' caches of ``files`` and list again each folder that holds more
    than ``LIST_FOLDER_PAST`` of them, on the protocols in ``stores`` (object stores, whose
    listings carry sizes and versions); the other files are asked about one by one."""
    folders: dict[int, tuple[Any, Counter[str]]] = {}
    for url in files:
        fs, path = resolve(url, storage_options)
        entry = folders.setdefault(id(fs), (fs, Counter()))
        entry[1][fs._parent(path)] += 1
    for fs, counts in folders.values():
        fs.invalidate_cache()
        if not stores.intersection(protocols(fs)):
            continue
        for folder, count in counts.items():
            if count > LIST_FOLDER_PAST:
                fs.ls(folder, detail=True)  # (the client keeps it: info and open read it)
