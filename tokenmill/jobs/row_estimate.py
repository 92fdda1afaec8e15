"""Estimating the rows of JSONL files on an object store, without downloading them.

    file sizes ──(one listing per folder)──────────────┐
    first SAMPLE_BYTES of up to SAMPLED_FILES files ───┴─► rows ≈ size x rows / byte of the
    (one ranged read each; decompressed where needed)      sampled files (pooled by codec)

Counting a remote JSONL input exactly means downloading all of it: 26 s for 5,000 files on
S3, a second full download of a 100 GB input. The progress bar only needs a total to show a
percentage and an ETA, so a remote file is sampled instead: its first SAMPLE_BYTES give its
bytes per row, and its size (from the listing) gives its rows. A file no larger than the
sample is read whole and counted exactly. The job learns the exact total anyway, once its
reader reaches the end of the input.

Compressed files are estimated from their compressed size and the rows per compressed byte
of their sample's decompressed prefix (gzip, zstd and xz decompress a prefix as far as it
goes, across members and frames), decompressed up to DECOMPRESSED_BYTES only: one prompt
repeated packs 300x in gzip and 10,000x in zstd, so a 1 MiB sample was 0.3 to 10 GiB of
text, held and split into lines on the count's threads. bzip2 is left unknown: its 900 KB
blocks give a 1 MiB prefix one block of rows at most, and the estimate would be far too low.
"""

from __future__ import annotations

import lzma
import threading
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from tokenmill.io.readers.compression import compression_by_magic, compression_by_suffix
from tokenmill.io.readers.file_reads import map_files
from tokenmill.io.readers.jsonl_records import blank_line
from tokenmill.io.readers.storage import resolve

__all__ = [
    "DECOMPRESSED_BYTES",
    "SAMPLE_BYTES",
    "SAMPLED_FILES",
    "RowTotal",
    "estimate_rows",
    "is_local",
]

SAMPLE_BYTES = 1 << 20  # read from the start of a sampled file
DECOMPRESSED_BYTES = 16 << 20  # of a compressed sample, the most its rows are counted in
# compressed bytes decompressed at a time: zstd's densest blocks (4 bytes for 128 KiB) make
# at most 8 MiB of them, so a sample stops within that of DECOMPRESSED_BYTES
_FEED_BYTES = 256
SAMPLED_FILES = 16  # files sampled; the others take the sampled files' rows per byte
_SIZES_BY_LISTING = 64  # more files than this: sizes from one listing per folder


@dataclass(frozen=True)
class RowTotal:
    """The input's rows: counted (``estimated`` False) or estimated from sampled bytes."""

    rows: int
    estimated: bool


class Stopped(Exception):
    """The count was stopped (its ``stop`` event set)."""


@dataclass(frozen=True)
class _Sample:
    rows: int  # complete, non-blank lines in the sample
    nbytes: int  # bytes of the file they came from (compressed bytes for a compressed file)
    codec: str | None


def is_local(url: str, storage_options: dict[str, Any]) -> bool:
    """Whether ``url`` is on the local filesystem (cheap to read whole)."""
    fs, _ = resolve(url, storage_options)
    return isinstance(fs, LocalFileSystem)


def estimate_rows(
    urls: list[str],
    storage_options: dict[str, Any],
    count_whole: Callable[[str], int],
    stop: threading.Event | None = None,
) -> RowTotal | None:
    """The rows of the JSONL files ``urls``: each file no larger than SAMPLE_BYTES counted
    exactly by ``count_whole(url)``, the others estimated (see the module docstring). None
    when a file's rows cannot be estimated: its size is unknown (an HTTP server that gives
    no length), its sample holds no whole row, it is bzip2, or no sampled file shares its
    compression. Raises Stopped once ``stop`` is set, and the storage's errors."""
    if not urls:
        return RowTotal(0, estimated=False)
    # one filesystem for all (a filesystem made per file cost 0.1 s each without fsspec's
    # instance cache)
    fs, _ = resolve(urls[0], storage_options)
    paths = {url: fs._strip_protocol(url) for url in urls}
    sizes = _sizes(fs, paths)
    if any(sizes.get(url) is None for url in urls):
        return None
    small = [url for url in urls if sizes[url] <= SAMPLE_BYTES]
    large = [url for url in urls if sizes[url] > SAMPLE_BYTES]

    def sample(url: str) -> _Sample | None:
        if stop is not None and stop.is_set():
            raise Stopped
        return _sample(fs, url, paths[url])

    sampled = large[:SAMPLED_FILES]
    samples = dict(zip(sampled, map_files(sample, sampled), strict=True))
    rows_per_byte = _pooled(samples)
    estimated = 0.0
    for url in large:
        codec = samples[url].codec if samples.get(url) else compression_by_suffix(url)
        if codec not in rows_per_byte:
            return None
        estimated += sizes[url] * rows_per_byte[codec]
    counted = sum(map_files(count_whole, small))
    return RowTotal(counted + round(estimated), estimated=bool(large))


def _pooled(samples: dict[str, _Sample | None]) -> dict[str | None, float]:
    """Rows per byte of the sampled files, by codec; none for a codec whose sample held no
    whole row (a row longer than the sample)."""
    rows: dict[str | None, int] = defaultdict(int)
    nbytes: dict[str | None, int] = defaultdict(int)
    unknown: set[str | None] = set()
    for s in samples.values():
        if s is None:
            continue
        rows[s.codec] += s.rows
        nbytes[s.codec] += s.nbytes
        if not s.rows:
            unknown.add(s.codec)
    return {codec: rows[codec] / nbytes[codec] for codec in rows if codec not in unknown}


def _sample(fs: AbstractFileSystem, url: str, path: str) -> _Sample | None:
    """The rows in the first SAMPLE_BYTES of ``url`` (one ranged read); None for bzip2."""
    head = fs.cat_file(path, start=0, end=SAMPLE_BYTES)
    codec = compression_by_suffix(url) or compression_by_magic(head[:10])
    if codec == "bz2":
        return None
    if codec is None:
        complete = head[: head.rfind(b"\n") + 1]  # rows cut at the sample's end not counted
        return _Sample(_rows_in(complete), len(complete), None)
    rows, used = _rows_decompressed(codec, head)
    return _Sample(rows, used, codec)


def _rows_in(text: bytes) -> int:
    """Non-blank complete lines of ``text``, a file's start (a line cut off at its end is
    not counted)."""
    lines = text.split(b"\n")[:-1]
    return sum(not blank_line(line, i) for i, line in enumerate(lines, start=1))


def _rows_decompressed(codec: str, head: bytes) -> tuple[int, int]:
    """(Non-blank complete lines in what the first bytes ``head`` of a ``codec`` file
    decompress to, as far as they go or until DECOMPRESSED_BYTES; ``head``'s bytes that
    took). The text is counted as it comes, never held whole. A file of many members or
    frames (``cat a.gz b.gz``, pigz's blocks, pzstd's skippable frame before each frame)
    is read across them: its first member alone was a few rows, or none."""
    decompressor, errors = _decompressor(codec)
    first = True  # still in the first member: an error there is the input's
    rows = lines = used = made = 0
    pending = b""  # bytes fed past a member's end, the next member's start
    line = bytearray()  # the line being decompressed (a long one grows here, not copied)
    while made < DECOMPRESSED_BYTES:
        if decompressor.eof:  # a decompressor takes one member (xz and zstd refuse more)
            pending, first = decompressor.unused_data, False
            decompressor, _ = _decompressor(codec)
        if pending:
            chunk, pending = pending, b""
        elif used < len(head):
            chunk = head[used : used + _FEED_BYTES]
            used += len(chunk)
        else:
            break
        try:
            text = decompressor.decompress(chunk)
        except errors:
            if first:
                raise
            break  # padding or other bytes after the last member: the rows so far count
        made += len(text)
        end = text.rfind(b"\n")
        if end < 0:
            line += text
            continue
        line += text[: end + 1]
        for complete in bytes(line).split(b"\n")[:-1]:
            lines += 1
            rows += not blank_line(complete, lines)
        line = bytearray(text[end + 1 :])
    return rows, used


def _decompressor(codec: str) -> tuple[Any, tuple[type[Exception], ...]]:
    """A decompressor of one ``codec`` member (gzip, xz or zstd), and the errors it raises
    on bytes that are not one."""
    if codec == "gzip":
        return zlib.decompressobj(wbits=31), (zlib.error,)
    if codec == "xz":
        return lzma.LZMADecompressor(), (lzma.LZMAError,)
    if codec != "zstd":  # bzip2 is not sampled: see the module docstring
        raise ValueError(f"no sample decompressor for {codec!r} files")
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj(), (zstandard.ZstdError,)


def _sizes(fs: AbstractFileSystem, paths: dict[str, str]) -> dict[str, int | None]:
    """Each file's size in bytes (None where the storage gives none), by URL: asked file by
    file for a few files, from one listing of each folder for many (5,000 HEAD requests
    took longer than the rows they would estimate)."""
    if len(paths) <= _SIZES_BY_LISTING:
        sizes = map_files(lambda path: _size(fs, path), list(paths.values()))
        return dict(zip(paths, sizes, strict=True))
    by_folder: dict[str, list[str]] = defaultdict(list)
    for url, path in paths.items():
        by_folder[path.rpartition("/")[0]].append(url)
    found: dict[str, int | None] = {}
    for folder, members in by_folder.items():
        listed = {e["name"].rstrip("/"): e.get("size") for e in fs.ls(folder, detail=True)}
        for url in members:
            path = paths[url]
            found[url] = listed[path] if path in listed else _size(fs, path)
    return found


def _size(fs: AbstractFileSystem, path: str) -> int | None:
    size = fs.info(path).get("size")
    return None if size is None else int(size)
