"""The job's output prefix: a local folder or an object-store prefix, written atomically.

Every file lands under the prefix with all of its bytes or not at all:

    local        <dir>/.<name>.tmp-<hex>  --write, fsync-->  os.replace  -->  <dir>/<name>
                 (then fsync <dir>, so the rename itself survives a power cut)
    object store one PUT of the whole bytes to the final key (S3/GCS/Azure show an object
                 only once its upload completes, multipart uploads included); ``writing``
                 spools them to a local temporary file first and uploads that

A writer killed between the two local steps leaves a ``.<name>.tmp-<owner>-<hex>`` file and
never a partial ``<name>``; ``cleanup_temp`` removes those leftovers. ``<owner>`` is a token
derived from the job's name, so cleanup removes only the temporary files of this job's own
writes, in the folders it writes to, and never a file someone else put there.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = [
    "OutputStore",
    "StorageError",
    "builtin_error",
    "is_temp_name",
    "make_folder",
    "owner_token",
]

_TEMP_NAME = re.compile(r"^\..+\.tmp-(?:[0-9a-f]{8}-)?[0-9a-f]{16}$")
# The only folders a job writes to, below its prefix: cleanup looks nowhere else.
_WRITTEN_FOLDERS = ("", "shards", "errors")
# Reads in flight at once in ``read_many`` where the filesystem has no async client of its own.
_READ_THREADS = 16


class StorageError(OSError):
    """An object store's client failed (connection refused, timeouts, 5xx after its retries).

    An OSError like a local disk's errors, whatever exception type the client raised, so
    callers treat every storage failure alike: committed work stays, a rerun resumes."""


@contextlib.contextmanager
def _client_errors(url: str, what: str) -> Iterator[None]:
    """Re-raise a store client's own exception types as StorageError, and its OSErrors
    (s3fs's PermissionError "Access Denied", FileNotFoundError "The specified bucket does
    not exist") as the same type naming ``url``."""
    try:
        yield
    except OSError as exc:
        if url in str(exc):
            raise
        try:
            named = type(exc)(f"{url}: {what} failed ({exc})")
        except Exception:  # a client's OSError subclass: botocore's take keywords only
            named = builtin_error(exc, f"{url}: {what} failed ({type(exc).__name__}: {exc})")
        raise named from exc
    except Exception as exc:
        raise StorageError(f"{url}: {what} failed ({type(exc).__name__}: {exc})") from exc


def builtin_error(exc: OSError, message: str) -> OSError:
    """An error saying ``message`` of the builtin OSError type ``exc`` is, for a client's
    subclass that cannot be built from a message (botocore's ConnectTimeoutError takes
    keywords only, and re-raised as it was it named no file): a missing file stays
    FileNotFoundError, a refused connection ConnectionError; a StorageError where that type
    is OSError itself."""
    builtin = next(t for t in type(exc).__mro__ if t.__module__ == "builtins")
    if builtin is OSError:
        return StorageError(message)
    return builtin(message) if exc.errno is None else builtin(exc.errno, message)


def make_folder(path: str) -> None:
    """Make the local folder ``path`` and its parents, if missing. Raises NotADirectoryError
    naming ``path`` where a file (or a dangling link) is there: os.makedirs' FileExistsError
    read as a storage error (exit 75, "rerun to resume"), and every rerun met the same file
    (an audit). Not FileExistsError as such: a temporary file's exclusive create may meet
    another's name by chance, which a rerun gets past."""
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(
            errno.ENOTDIR, "a file is where the job writes a folder; move or remove it", path
        ) from None


def is_temp_name(basename: str) -> bool:
    """True for the temporary names ``write_atomic`` uses before its rename (any owner's)."""
    return _TEMP_NAME.match(basename) is not None


def owner_token(owner: str) -> str:
    """The 8 hex digits that mark the temporary files written for ``owner`` (a job name)."""
    return hashlib.sha256(owner.encode()).hexdigest()[:8]


def _check_name(name: str, where: str) -> str:
    """Return ``name`` if it is a relative path that stays below the prefix, else raise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: empty file name {name!r}; give a path relative to the output")
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise ValueError(
            f"{where}: {name!r} is absolute; output files are named relative to the output prefix"
        )
    parts = name.split("/")
    if any(p in ("", ".", "..") or "\\" in p for p in parts):
        raise ValueError(
            f"{where}: {name!r} has an empty, '.', '..' or backslash component; "
            "output files must stay below the output prefix"
        )
    return name


class OutputStore:
    """The job's output prefix. Every write goes below it; anything else raises ValueError.

    ``url`` is a local path or an fsspec URL (``s3://bucket/prefix/``, ``gs://…``,
    ``file:///…``); ``storage_options`` go to the fsspec filesystem (credentials,
    ``endpoint_url``, …). ``owner`` (the job name) marks this store's temporary files, so that
    ``cleanup_temp`` removes only those. Attributes: ``url`` (as given, without trailing
    slashes), ``root`` (absolute local directory, or the bucket path without protocol),
    ``is_local``, ``fs``.
    """

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, owner: str = ""
    ) -> None:
        if not isinstance(url, str) or not url.strip():
            raise ValueError("output.path is empty; give a local folder or an s3://… prefix")
        self.url = url.rstrip("/") or "/"
        self._token = owner_token(owner)
        self.storage_options = dict(storage_options or {})
        try:
            fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        except (ImportError, ValueError) as exc:
            raise ValueError(
                f"output.path {url!r}: cannot open its filesystem ({exc}); for s3:// install "
                "s3fs (pip install 'tokenmill[s3]'), and check output.storage_options"
            ) from None
        if type(fs).__name__ == "HTTPFileSystem":  # fsspec's http(s): reads only
            raise ValueError(
                f"output.path {url!r} is an http(s) URL, which can only be read; write to a "
                "local folder or an object store (s3://bucket/prefix)"
            )
        self.fs: fsspec.AbstractFileSystem = fs
        self.is_local: bool = isinstance(fs, LocalFileSystem)
        self.root: str = os.path.abspath(root) if self.is_local else root.rstrip("/")
        # A local root once seen is not made again by a write: see ``_local_file``.
        self._root_seen = self.is_local and os.path.isdir(self.root)
        if not self.is_local and not self.root:
            raise ValueError(f"output.path {url!r} names no bucket; give e.g. s3://bucket/prefix")
        if not self.is_local and {"", ".", ".."} & set(self.root.strip("/").split("/")):
            raise ValueError(
                f"output.path {url!r} has an empty, '.' or '..' segment, which an object store "
                "keeps as part of its keys; write the prefix plainly (s3://bucket/a/b)"
            )

    @property
    def identity(self) -> str:
        """The output as one string whatever its spelling: the filesystem's own protocol
        name and the root (``s3a://b/o/`` and ``s3://b/o`` are one output)."""
        return self.url_of(self.root)

    def url_of(self, path: str) -> str:
        """``path`` (of this store's filesystem, as ``root`` is) as a URL: itself when
        local, else with the filesystem's own protocol name."""
        protocol = self.fs.protocol
        name = protocol if isinstance(protocol, str) else protocol[0]
        return path if self.is_local else f"{name}://{path}"

    def __repr__(self) -> str:
        return f"OutputStore({self.url!r})"

    # -- names -----------------------------------------------------------------------------

    def path(self, name: str) -> str:
        """The full path (local) or URL (object store) of ``name``; raises ValueError when
        ``name`` is empty, absolute or climbs out with ``..``."""
        return self._full(_check_name(name, f"output {self.url}"))

    def _full(self, name: str) -> str:
        if self.is_local:
            return os.path.join(self.root, *name.split("/"))
        return self.fs.unstrip_protocol(f"{self.root}/{name}")

    def _fs_path(self, name: str) -> str:
        """The path the filesystem's own methods take (no protocol)."""
        if self.is_local:
            return self.path(name)
        return f"{self.root}/{_check_name(name, f'output {self.url}')}"

    # -- writing ---------------------------------------------------------------------------

    def write_atomic(self, name: str, data: bytes) -> None:
        """Commit ``data`` as ``name``, all or nothing, replacing any older file.

        Local: temp file in the same folder, fsync, ``os.replace``, fsync of the folder.
        Object store: one ``fs.pipe`` of the whole bytes. Creates parent folders. Raises
        ValueError for a bad name; OSError (or the store client's error) when the write fails,
        in which case ``name`` keeps its previous content, if any.
        """
        self._check_writable(name)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"write_atomic({name!r}) takes bytes, got {type(data).__name__}")
        if self.is_local:
            with self._local_file(self.path(name)) as f:
                f.write(data)
        else:
            with _client_errors(self.url, f"writing {name}"):
                self.fs.pipe_file(self._fs_path(name), bytes(data))

    @contextlib.contextmanager
    def writing(self, name: str) -> Iterator[BinaryIO]:
        """A binary file to write ``name``'s content into, committed as ``name`` when the block
        ends, all or nothing as ``write_atomic`` commits bytes: a large file (a shard) is
        never held in memory whole. When the block raises, ``name`` keeps its previous
        content, if any, and nothing is uploaded.

        Local: ``write_atomic``'s temp file, fsync and ``os.replace``. Object store: spooled
        to a local temporary file, then one ``fs.put_file`` (one PUT, or a multipart upload
        the store shows only once complete). Not a file of ``fs.open`` written as we go: its
        ``close``, on an error too, completes the upload, leaving a partial object. Raises
        as ``write_atomic`` does.
        """
        self._check_writable(name)
        if self.is_local:
            with self._local_file(self.path(name)) as f:
                yield f
            return
        with tempfile.NamedTemporaryFile(prefix="tokenmill-") as spool:
            yield spool
            spool.flush()
            with _client_errors(self.url, f"writing {name}"):
                self.fs.put_file(spool.name, self._fs_path(name))

    def _check_writable(self, name: str) -> None:
        _check_name(name, f"output {self.url}")
        if is_temp_name(name.rsplit("/", 1)[-1]):
            raise ValueError(
                f"output {self.url}: {name!r} looks like a temporary file name; "
                "choose another name (cleanup_temp would delete it)"
            )

    @contextlib.contextmanager
    def _local_file(self, final: str) -> Iterator[BinaryIO]:
        folder, base = os.path.split(final)
        if self._root_seen and not os.path.isdir(self.root):
            # Removed since (``rm -rf out/``, under a running job): made again, it held
            # a lone shard the next run took for another's files and refused, --fresh too
            # (an audit). The job's lock fence then says the folder went (lock.py).
            raise FileNotFoundError(errno.ENOENT, "the output folder was removed", self.root)
        make_folder(folder)
        self._root_seen = True
        tmp = os.path.join(folder, f".{base}.tmp-{self._token}-{secrets.token_hex(8)}")
        try:
            with open(tmp, "xb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as exc:
            _remove_quietly(tmp)
            if exc.errno is None or exc.filename not in (None, tmp):
                raise
            # A failed write or fsync (disk full, EFBIG, EIO) names no file, a failed open or
            # rename the temporary one, just removed (a hidden ".part-00001.jsonl.tmp-…"
            # the user never made and cannot find): name the file being written, so that
            # the message says which output (and disk or folder) to look at.
            raise type(exc)(exc.errno, exc.strerror, final) from exc
        except BaseException:
            _remove_quietly(tmp)
            raise
        _fsync_dir(folder)

    def delete(self, name: str) -> None:
        """Remove ``name``; a missing file is fine."""
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path(name))
            return
        path = self._fs_path(name)
        with _client_errors(self.url, f"deleting {name}"), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)
        self.fs.invalidate_cache(path)

    def delete_many(self, names: list[str]) -> None:
        """Remove ``names`` (missing ones are fine): on an object store in batched requests
        (S3 takes up to 1,000 keys a call), not one request a file. Not where a path holds
        a glob character (``*``, ``?``, ``[``: fsspec's ``rm`` expands them as a pattern, so
        removing ``s3://b/out[1]/x`` removed ``s3://b/out1/x``, another output's file: an
        audit): one request a file then, which never expands."""
        paths = [] if self.is_local else [self._fs_path(n) for n in names]
        if len(paths) < 2 or any(_GLOB.search(p) for p in paths):
            for name in names:
                self.delete(name)
            return
        with _client_errors(self.url, f"deleting {len(names)} files"):
            try:
                self.fs.rm(paths)
            except FileNotFoundError:  # some gone already: the rest one by one
                for name in names:
                    self.delete(name)
        for path in paths:
            self.fs.invalidate_cache(path)

    def still_there(self, names: list[str]) -> list[str]:
        """Those of ``names`` the store still holds, listed again a folder at a time: after
        ``delete_many`` on an object store, whose batched delete S3 answers per key and s3fs
        drops the refusals (AccessDenied on some keys). [] on a local store, whose deletes
        raise by themselves."""
        if self.is_local or not names:
            return []
        folders = sorted({name.rsplit("/", 1)[0] + "/" if "/" in name else "" for name in names})
        held = {name for folder in folders for name in self.list(folder)}
        return [name for name in names if name in held]

    def cleanup_temp(self) -> int:
        """Remove temporary files a killed writer of this owner left behind; return how many.

        Only names of this store's own pattern (``.<name>.tmp-<owner token>-<hex>``) in the
        folders a job writes (the prefix itself, ``shards/``, ``errors/``, the manifests'
        journals ``<job>.manifest.d/``) are touched. Object
        stores never hold any (a PUT has no temporary name), so this is 0 there. Call it only
        while no other writer of this output runs (under the job lock).
        """
        if not self.is_local:
            return 0
        own = re.compile(rf"^\..+\.tmp-{self._token}-[0-9a-f]{{16}}$")
        removed = 0
        try:
            journals = [d for d in os.listdir(self.root) if d.endswith(".manifest.d")]
        except FileNotFoundError:
            journals = []
        for sub in (*_WRITTEN_FOLDERS, *journals):
            folder = os.path.join(self.root, sub) if sub else self.root
            try:
                names = os.listdir(folder)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for base in names:
                path = os.path.join(folder, base)
                if own.match(base) and os.path.isfile(path) and not os.path.islink(path):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)
                        removed += 1
        return removed

    # -- reading ---------------------------------------------------------------------------

    def read_bytes(self, name: str) -> bytes | None:
        """The content of ``name``, or None when it does not exist."""
        try:
            if self.is_local:
                with open(self.path(name), "rb") as f:
                    return f.read()
            with _client_errors(self.url, f"reading {name}"):
                return self.fs.cat_file(self._fs_path(name))
        except FileNotFoundError:
            return None

    def read_many(self, names: list[str]) -> list[bytes | None]:
        """``read_bytes`` of each of ``names``, in their order, fetched concurrently: on an
        object store each GET costs 10-50 ms, so reading a manifest's journal of 1,000 records
        one after another had taken 10-50 s. Async filesystems (s3fs, gcsfs, adlfs) take them
        all in one ``cat_ranges`` call (not ``cat``, which reads ``*?[`` in a path as a
        pattern: ``delete_many``'s audit); others, local folders included, a pool of threads.
        A file missing is None; a store that fails raises (as ``read_bytes``), the error of
        the first failed name in the list's order."""
        if self.is_local or not getattr(self.fs, "async_impl", False) or len(names) < 2:
            with ThreadPoolExecutor(min(_READ_THREADS, max(1, len(names)))) as pool:
                return list(pool.map(self.read_bytes, names))
        paths = [self._fs_path(n) for n in names]
        with _client_errors(self.url, f"reading {len(names)} files"):
            found = self.fs.cat_ranges(paths, None, None, on_error="return")
        out: list[bytes | None] = []
        for name, got in zip(names, found, strict=True):
            if isinstance(got, FileNotFoundError):
                out.append(None)
            elif isinstance(got, BaseException):
                with _client_errors(self.url, f"reading {name}"):
                    raise got
            else:
                out.append(got)
        return out

    def exists(self, name: str) -> bool:
        """Whether ``name`` exists (as a file). A store that fails to answer raises (an
        OSError naming the output): fsspec's ``isfile`` answers False on any error, and
        "not there" is what a store that is down must never be taken to say."""
        if self.is_local:
            return os.path.isfile(self.path(name))
        path = self._fs_path(name)
        self.fs.invalidate_cache(path)  # another process may have written it
        try:
            with _client_errors(self.url, f"looking for {name}"):
                return self.fs.info(path).get("type") == "file"
        except FileNotFoundError:
            return False

    def list(self, prefix: str = "") -> list[str]:
        """Names (relative to the store, '/'-separated) that start with ``prefix``, sorted.

        ``prefix`` is a plain string prefix: ``"shards/"`` or ``"shards/part-0001"``. Temporary
        files of in-flight local writes are left out.
        """
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        if folder:
            _check_name(folder, f"output {self.url}: list({prefix!r})")
        if not self.is_local:
            return sorted(self.sizes(prefix))
        names = self._walk_local(os.path.join(self.root, *folder.split("/")))
        return sorted(n for n in names if n.startswith(prefix))

    def top_names(self) -> list[str]:
        """Names of the files directly under the prefix (not in subfolders), sorted."""
        if self.is_local:
            try:
                return sorted(
                    n
                    for n in os.listdir(self.root)
                    if os.path.isfile(os.path.join(self.root, n)) and not is_temp_name(n)
                )
            except (FileNotFoundError, NotADirectoryError):
                return []
        self.fs.invalidate_cache(self.root)
        try:
            with _client_errors(self.url, "listing"):
                found = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return sorted(
            info["name"].rsplit("/", 1)[-1] for info in found if info.get("type") == "file"
        )

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """``{name: size in bytes}`` of the files ``list(prefix)`` would return (one listing
        call on object stores)."""
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        if self.is_local:
            out = {}
            for name in self.list(prefix):
                with contextlib.suppress(FileNotFoundError):
                    out[name] = os.path.getsize(self._full(name))
            return out
        base = f"{self.root}/{_check_name(folder, f'output {self.url}')}" if folder else self.root
        self.fs.invalidate_cache(base)
        try:
            with _client_errors(self.url, "listing"):
                found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        cut = len(self.root) + 1
        return {
            p[cut:]: int(info.get("size") or 0)
            for p, info in found.items()
            if p.startswith(self.root + "/") and p[cut:].startswith(prefix)
        }

    def _walk_local(self, top: str) -> list[str]:
        names = []
        for folder, _dirs, files in os.walk(top):
            rel = os.path.relpath(folder, self.root)
            for base in files:
                if is_temp_name(base):
                    continue
                names.append(base if rel == "." else f"{rel.replace(os.sep, '/')}/{base}")
        return names


_GLOB = re.compile(r"[*?\[]")  # what fsspec's path expansion reads as a pattern


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _fsync_dir(folder: str) -> None:
    """Make a rename in ``folder`` durable. Some filesystems refuse to fsync a folder; the
    rename is still atomic there, only its durability across a power cut is weaker."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
