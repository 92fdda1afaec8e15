"""input_fingerprint: a cheap, stable hash that changes when the input's data changes."""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

import fsspec

from tokenmill.io.readers.compression import (
    compression_by_magic,
    compression_by_suffix,
    open_input,
    peek_block_size,
)
from tokenmill.io.readers.file_listing import list_input_files
from tokenmill.io.readers.file_reads import map_files
from tokenmill.io.readers.format_detection import detect_format, input_format
from tokenmill.io.readers.input_config import InputConfig
from tokenmill.io.readers.jsonl_records import blank_line
from tokenmill.io.readers.listing_cache import list_again
from tokenmill.io.readers.parquet_footers import ParquetFooters, footer_from_tail
from tokenmill.io.readers.storage import protocols, resolve
from tokenmill.io.url_secrets import hide_url_secrets

EDGE_BYTES = 1 << 20  # hash this much of each file's start and end
_VERSION = 1  # bump when what goes into the fingerprint changes
MAX_NAMED_VERSIONS = 1000  # input files whose versions are kept one by one (_named_versions)
# Input files whose entries are kept one by one (``entries``): past that, none. The manifest
# is rewritten as a long job goes; 256 URLs of ~190 characters add ~54 KB to it.
MAX_NAMED_FILES = 256
# The fields of an object store's file info that name the content of an object (its
# ``fs.info``, from a HEAD or a listing), first found wins: S3's ETag (an MD5, or
# "md5-parts" for a multipart upload), GCS's MD5 (absent for a composed object: then its
# generation), Azure's ETag. Other filesystems have none: a local file's mtime changes with
# every copy, and an HTTP server's ETag is often made of the mtime too.
_VERSION_FIELDS = {
    "s3": ("ETag",),
    "s3a": ("ETag",),
    "gs": ("md5Hash", "generation"),
    "gcs": ("md5Hash", "generation"),
    "az": ("etag",),
    "abfs": ("etag",),
    "abfss": ("etag",),
}


class InputFingerprint(NamedTuple):
    """What ``fingerprint_input`` tells of the input."""

    digest: str  # input_fingerprint
    counts: dict[str, int]  # {"files": how many, "bytes": their sizes' sum}
    # {url: the store's content version} for the files that have one (_named_versions)
    versions: dict[str, str]
    # {url (no password, no query string): a short hash of its content's entry (size, first
    # and last MiB)} for up to MAX_NAMED_FILES files (none past that): which files changed
    entries: dict[str, str]
    # ``digest`` as versions before 5d2d81c (2026-12-06) hashed it, each URL whole (an
    # HTTP(S) URL's query string, a password): a job begun then resumes. None where every
    # URL is hashed as it was then.
    earlier: str | None = None
    # the format the input resolved to (input.format, or what "auto" found): whether its
    # rows may carry their own constraints (OpenAI Batch bodies' response_format)
    format: str = "auto"


def input_fingerprint(cfg: InputConfig) -> str:
    """A hex sha256 over the resolved files and how they are read.

    Covers: the sorted file URLs, each file's size and a hash of its first and last MiB, the
    resolved format, and the columns that format reads. Not covered: storage_options
    (credentials), and edits in the middle of a file that keep its size — a cheap check, not
    a full content hash, so that fingerprinting terabytes costs two reads per file.
    """
    return fingerprint_input(cfg)[0]


def fingerprint_input(cfg: InputConfig, fresh: bool = False) -> InputFingerprint:
    """``input_fingerprint`` with the files' counts, which say what kind of change a changed
    fingerprint is (a file added, one rewritten), each file's entry hashed (up to
    MAX_NAMED_FILES), which say which files, and their objects' versions, which tell an
    object rewritten in its middle at the same size (the digest reads only its edges).
    ``fresh``: ask the store again for each file's size and version rather than take them
    from a listing the filesystem cached (a check that the input has not changed since)."""
    files = list_input_files(cfg)
    if fresh:  # (listing_cache.py says why)
        list_again(files, cfg.storage_options, set(_VERSION_FIELDS))
        fmt = detect_format(files, cfg.format, cfg.storage_options)  # as the store has it now
    else:
        fmt = input_format(cfg, files)
    how: dict[str, Any] = {"v": _VERSION, "format": fmt, "passthrough": cfg.passthrough_columns}
    if fmt != "openai-batch":
        how |= {"id": cfg.id_column, "prompt": cfg.prompt_column, "messages": cfg.messages_column}
        if cfg.structured_output_column is not None:  # absent when unset: old jobs resume
            how["structured_output"] = cfg.structured_output_column
    digest = hashlib.sha256(json.dumps(how, sort_keys=True).encode())
    earlier = digest.copy()
    whole = True  # whether every URL is hashed as earlier versions hashed it
    size = 0
    lines = fmt != "parquet"
    versions: dict[str, str] = {}
    named: dict[str, str] = {}
    # (Parquet: each file's last MiB holds its footer, kept for the row count and the schema)
    footers = None if lines else cfg.footers

    def entry_of(url: str) -> tuple[list[Any], str | None]:
        return _file_entry(url, cfg.storage_options, lines, footers, cfg.passthrough_columns)

    entries = map_files(entry_of, files)
    for entry, version in entries:
        # hashed under the URL as shown: a presigned URL signed again or a new password names
        # the same file (the same as before for a URL without either)
        shown = shown_url(entry[0])
        digest.update(json.dumps([shown, *entry[1:]]).encode())
        earlier.update(json.dumps(entry).encode())
        whole = whole and shown == entry[0]
        size += entry[1]
        if version is not None:
            versions[entry[0]] = version
        if len(files) <= MAX_NAMED_FILES:  # the content's hash, under the URL as shown
            content = json.dumps(entry[1:]).encode()  # (a changed password changes no file)
            named[shown] = hashlib.sha256(content).hexdigest()[:16]
    counts = {"files": len(files), "bytes": size}
    return InputFingerprint(
        digest.hexdigest(),
        counts,
        _named_versions(versions),
        named,
        None if whole else earlier.hexdigest(),
        fmt,
    )


def shown_url(url: str) -> str:
    """``url`` as the manifest keeps it: no password (``user:***@``) and no query string (a
    presigned URL's signature, a token) where it is an HTTP(S) URL: a local file's or an
    object's name may hold "?" or "#" (``part#1.jsonl``), and is kept whole."""
    shown = hide_url_secrets(url)
    if not shown.lower().startswith(("http://", "https://")):
        return shown
    return shown.split("?", 1)[0].split("#", 1)[0]


def unchanged_by_versions(
    cfg: InputConfig, versions: dict[str, str], counts: dict[str, int] | None
) -> bool:
    """Whether the store says, reading no file, that the input is as ``fingerprint_input``
    found it (its ``versions`` and ``counts`` then): every file has a content version (an
    object store's ETag or MD5, which any write changes), the same as then, and the files'
    count and sizes are the same. False where it cannot tell (a file without a version, a
    manifest without counts) or something changed: then ``fingerprint_input(cfg,
    fresh=True)`` decides, reading each file's first and last MiB again (up to 2 GB for
    1,000 files, what the run's start read). Asks the store again, as ``fresh`` does: on a
    local S3 (moto), 200 objects of 3 MB, 2.4 s by the reads, 0.11 s by one listing."""
    if not versions or counts is None:
        return False
    files = list_input_files(cfg)
    list_again(files, cfg.storage_options, set(_VERSION_FIELDS))

    def listed(url: str) -> tuple[int | None, str | None]:
        fs, path = resolve(url, cfg.storage_options)
        info = fs.info(path)
        return info.get("size"), content_version(fs, info)

    now = map_files(listed, files)
    if any(size is None or version is None for size, version in now):
        return False
    sizes = sum(size for size, _ in now)
    if counts != {"files": len(files), "bytes": sizes}:
        return False
    return _named_versions({url: v for url, (_, v) in zip(files, now, strict=True)}) == versions


def _named_versions(versions: dict[str, str]) -> dict[str, str]:
    """``versions`` as the manifest keeps them: by URL up to ``MAX_NAMED_VERSIONS`` files;
    past that one digest of them all under ``"any of <n> objects"``, so that the manifest,
    rewritten as a long job goes, does not grow with the input's file count."""
    if len(versions) <= MAX_NAMED_VERSIONS:
        return versions
    pairs = json.dumps(sorted(versions.items())).encode()
    return {f"any of {len(versions)} objects": hashlib.sha256(pairs).hexdigest()}


def _file_entry(
    url: str,
    storage_options: dict[str, Any],
    lines: bool = False,
    footers: ParquetFooters | None = None,
    columns: tuple[str, ...] = (),
) -> tuple[list[Any], str | None]:
    """(entry, version): the entry is the file's URL, size and hashes of its first and last
    MiB, for a line format (``lines``) whose first line is a byte-order mark alone
    "bom-line" too; the version is the store's (``content_version``), from the file info
    its size comes from. Keeps in ``footers`` the Parquet footer its last MiB holds (with
    the types of ``columns``), where it holds one whole."""
    fs, path = resolve(url, storage_options)
    # (a small block: the default's 50 MiB on S3 fetched whole files for their edges)
    with fs.open(path, "rb", block_size=peek_block_size(fs)) as f:
        info = _opened_info(fs, path, f)
        size = info.get("size")
        head = _read_up_to(f, EDGE_BYTES)
        if size is None:  # an HTTP server that sends no length: read through to the end
            size, tail = _read_to_end(f, head)
        else:
            f.seek(max(size - EDGE_BYTES, 0))
            tail = f.read(EDGE_BYTES)
    entry = [url, size, hashlib.sha256(head).hexdigest(), hashlib.sha256(tail).hexdigest()]
    footer = None if footers is None else footer_from_tail(tail, columns)
    if footer is not None:
        footers.keep(url, footer)
    if lines and not head.startswith(b"{") and _mark_alone_first(url, head, storage_options):
        entry.append("bom-line")
    return entry, content_version(fs, info)


def _opened_info(fs: fsspec.AbstractFileSystem, path: str, f: Any) -> dict[str, Any]:
    """The file info of ``path``, open as ``f``: on an object store (``_VERSION_FIELDS``)
    the one its open asked the store for (fsspec's buffered files keep it as ``details``,
    and s3fs reads with its ETag), else the filesystem's. Asking again cost a second HEAD a
    file where no listing held it (a single-file input)."""
    if set(protocols(fs)) & set(_VERSION_FIELDS):
        details = getattr(f, "details", None)
        if isinstance(details, dict):
            return details
    return fs.info(path)


def content_version(fs: fsspec.AbstractFileSystem, info: dict[str, Any]) -> str | None:
    """The version an object store gives a file's content (``_VERSION_FIELDS``) as one
    string, or None where it gives none. The same from a listing as from a HEAD: S3 quotes
    its ETags (and a weak one starts ``W/``), so both go."""
    fields = next((_VERSION_FIELDS[p] for p in protocols(fs) if p in _VERSION_FIELDS), ())
    value = next((info[name] for name in fields if info.get(name) not in (None, "")), None)
    if value is None:
        return None
    return str(value).strip().removeprefix("W/").strip('"') or None


def _mark_alone_first(url: str, head: bytes, storage_options: dict[str, Any]) -> bool:
    """Whether the file's first line (decompressed) is a byte-order mark alone. Such a line
    was an error row (row 0) before 9800fb8 and is no row since, so every later row's index
    moved by one: the mark in the fingerprint refuses a resume of a job begun before (it
    would lose a row and repeat one); every other file keeps the entry old jobs resume with.
    ``head``: the file's first bytes, which hold the line unless the file is compressed
    (then it is opened again, decompressing its first line)."""
    if compression_by_suffix(url) or compression_by_magic(head[:10]):
        with open_input(url, storage_options, peek=True) as f:
            first = f.readline()
    else:
        first = head.split(b"\n", 1)[0]
    return blank_line(first, 1) and bool(first.strip())  # blank to the reader only for the mark


def _read_to_end(f: Any, head: bytes) -> tuple[int, bytes]:
    """(size, last EDGE_BYTES) of a file read as far as ``head``, read on to its end: the
    entry is the one a known size gives, so a server's sending the length or not changes
    nothing."""
    size, tail = len(head), head
    while chunk := f.read(EDGE_BYTES):
        size += len(chunk)
        tail = (tail + chunk)[-EDGE_BYTES:]
    return size, tail


def _read_up_to(f: Any, n: int) -> bytes:
    """``n`` bytes of ``f``, fewer only at its end (a streamed response's read returns what
    has arrived)."""
    parts, left = [], n
    while left and (chunk := f.read(left)):
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)
