"""Opening an input file as a stream of decompressed bytes: the one way readers open JSONL.

    x.jsonl.gz ──suffix──► gzip ──┐
    x.ndjson.zst ────────► zstd ──┼─► codec from fsspec's registry ─► buffered, line-iterable
    x.jsonl ──magic bytes─► none ─┘   (fsspec.compression.compr)      stream; never read whole

Suffixes: ``.gz`` gzip, ``.zst`` zstd (needs the ``zstandard`` package), ``.bz2`` bzip2,
``.xz`` xz. The codecs are fsspec's own, the ones ``fs.open(path, compression=...)`` applies;
they are wrapped here rather than asked for through ``fs.open`` because gzip, bz2 and xz
never close the file under them, and zstandard's reader cannot iterate lines.

A file whose name names no compression but whose first bytes are a gzip, zstd, bzip2 or xz
magic number is **decompressed by its magic**. That is safe: none of those magics can start
UTF-8 JSON text (gzip ``1f 8b``, zstd ``28 b5 2f fd`` and xz ``fd 37 7a 58 5a 00`` are not
valid UTF-8, a zstd skippable frame's ``5? 2a 4d 18``, pzstd's start, is no JSON; bzip2's
ASCII ``BZh9`` is only taken with the block or end-of-stream magic that must follow it, ten
bytes in all), and it reads a misnamed ``prompts.jsonl`` that is really
gzip instead of failing every row as "not valid UTF-8". A name whose compression the bytes do
not carry (``x.jsonl.gz`` holding plain text) is a ValueError naming the file.

zstd is decompressed frame by frame here (``_ZstdFrames``), not by fsspec's codec: zstandard's
stream reader ends quietly at a file cut short inside a frame, so a truncated file read as a
shorter, valid one and its last rows were lost; here it raises like gzip, bzip2 and xz do.

A look at a file's start (format detection, the preflight's column check, the fingerprint's
edges) opens it with ``peek_block_size``, small blocks: fsspec fetches a read's bytes and one
block more, and s3fs's default block is 50 MiB, so a 10-byte read fetched the whole of a 3 MB
object, or 50 MiB of a larger one. The run's own reader reads whole files and keeps the
filesystem's default (fewer, larger requests).

Limits: a decompressing stream cannot seek, so a reader that must start over reopens the file.
"""

from __future__ import annotations

import io
from typing import IO, Any

import fsspec
from fsspec.compression import compr

from tokenmill.io.readers.storage import is_read_error, protocols, read_failed, resolve
from tokenmill.io.storage import StorageError
from tokenmill.io.url_secrets import without_query

# Suffix -> fsspec codec name.
COMPRESSION_SUFFIXES: dict[str, str] = {".gz": "gzip", ".zst": "zstd", ".bz2": "bz2", ".xz": "xz"}

# Codec name -> the shell command that undoes it, for messages.
DECOMPRESS_COMMANDS: dict[str, str] = {
    "gzip": "gunzip",
    "zstd": "zstd -d",
    "bz2": "bunzip2",
    "xz": "unxz",
}

_MAGIC_BYTES = 10
_BZIP2_STREAM_MAGICS = (b"1AY&SY", b"\x17rE8P\x90")  # first block / end of an empty stream
# A zstd skippable frame starts with one of 16 magics, 0x184D2A50-5F little-endian: pzstd
# (zstd's parallel CLI) puts one before each frame, so its files start with one; zstd -d
# reads them. (Its first byte is an ASCII letter P-Z or [\]^_, which never starts JSON.)
_ZSTD_SKIPPABLE_TAIL = b"\x2a\x4d\x18"
_STREAM_BUFFER = 1 << 18  # decompressed bytes buffered for line iteration
# fsspec's block for a look at a file's start: what a read fetches past its own bytes. A
# request to an object store costs tens of milliseconds, so not smaller: 1,000 lines of 10 KB
# (the preflight's look) are 40 requests.
PEEK_BLOCK_SIZE = 1 << 18


class CorruptInputError(ValueError):
    """An input file's compressed data is truncated or corrupt (named in the message):
    rerunning does not help until the file is replaced."""


def compression_by_suffix(url: str) -> str | None:
    """The fsspec codec name the suffix of ``url`` names ("gzip", "zstd", "bz2", "xz"), or None
    (an HTTP(S) URL's query string, a presigned URL's signature, is not its name)."""
    lower = without_query(url).lower()
    for suffix, name in COMPRESSION_SUFFIXES.items():
        if lower.endswith(suffix):
            return name
    return None


def strip_compression_suffix(url: str) -> str:
    """``url`` without its compression suffix: "x.jsonl.gz" -> "x.jsonl"; others unchanged."""
    lower = url.lower()
    for suffix in COMPRESSION_SUFFIXES:
        if lower.endswith(suffix):
            return url[: -len(suffix)]
    return url


def compression_by_magic(head: bytes) -> str | None:
    """The codec whose magic number starts ``head`` (a file's first 10 bytes), or None."""
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "zstd"
    if head[:1] and 0x50 <= head[0] <= 0x5F and head[1:4] == _ZSTD_SKIPPABLE_TAIL:
        return "zstd"
    if head.startswith(b"\xfd7zXZ\x00"):
        return "xz"
    if head.startswith(b"BZh") and head[3:4] in b"123456789" and head[4:10] in _BZIP2_STREAM_MAGICS:
        return "bz2"
    return None


def peek_block_size(fs: fsspec.AbstractFileSystem) -> int | None:
    """fsspec's block for a look at the start of a file of ``fs``: ``PEEK_BLOCK_SIZE``, or
    None (its default, 5 MiB) over HTTP(S): a server that answers no range request is read
    only within the first block (fsspec refuses a read past it), which a small one cut short
    (a fingerprint's last MiB)."""
    return None if {"http", "https"} & set(protocols(fs)) else PEEK_BLOCK_SIZE


def open_input(url: str, storage_options: dict[str, Any], peek: bool = False) -> IO[bytes]:
    """Open input file ``url`` for reading its decompressed bytes; close it when done.

    The codec comes from the suffix or, for a name without one, the magic number (see the
    module docstring). Plain files come back as fsspec opened them (seekable); compressed
    ones, plain ones that cannot seek (a streamed HTTP response) and any opened to ``peek``,
    as a buffered stream that iterates lines but cannot seek.
    ``peek``: for a look at the file's start (its first lines), which fetches about what it
    reads (``peek_block_size``); else fsspec's default block, for reading the whole file.
    Raises ValueError naming the file when the bytes do not match the suffix's compression,
    when the codec is not installed (zstd without ``zstandard``), or, while reading, when the
    compressed data is corrupt or truncated; FileNotFoundError when the file is missing.
    """
    fs, path = resolve(url, storage_options)
    block_size = peek_block_size(fs) if peek else None
    try:
        raw = fs.open(path, "rb", block_size=block_size)
    except Exception as e:  # (its first look at the object: the store's error names none)
        if is_read_error(e):
            raise read_failed(url, e) from e
        raise
    streamed = False
    try:
        head = raw.read(_MAGIC_BYTES)
        try:
            raw.seek(0)
        except (OSError, ValueError, NotImplementedError):
            # A streaming filesystem file (HTTP) cannot seek back: start it over.
            raw.close()
            raw = fs.open(path, "rb", block_size=block_size)
            streamed = True
        codec = _codec(url, head)
        if codec is None and not streamed and not peek:
            return raw
        if codec is None:
            # fsspec's own line iteration reads a block ahead and seeks back after each line:
            # a streamed file refuses, and past a small block's cache each block was fetched
            # again (1.75 MiB for a look at 260 KB of lines on S3)
            return io.BufferedReader(_Streamed(raw), _STREAM_BUFFER)
        if codec not in compr:
            raise ValueError(
                f"{url} is {codec}-compressed but this Python has no {codec} codec; "
                + ("pip install zstandard" if codec == "zstd" else "decompress it first")
            )
        source = _SourceReads(raw)
        stream = _ZstdFrames(source) if codec == "zstd" else compr[codec](source, mode="r")
        return io.BufferedReader(_Decompressed(url, codec, stream, source, raw), _STREAM_BUFFER)
    except Exception as e:
        raw.close()
        if is_read_error(e):
            raise read_failed(url, e) from e
        raise
    except BaseException:
        raw.close()
        raise


def _codec(url: str, head: bytes) -> str | None:
    by_name = compression_by_suffix(url)
    by_magic = compression_by_magic(head)
    if by_name is None or by_name == by_magic:
        return by_magic
    if not head:
        return None  # an empty file holds no rows, whatever its name says
    found = f"{by_magic} data" if by_magic else f"not {by_name} data"
    raise ValueError(
        f"{url}: the name says {by_name} but the file is {found} (it starts with "
        f"{head[:4]!r}); rename it to match its contents"
    )


class _SourceReads:
    """The compressed file under a codec, keeping the error a read of it raised: codecs pass
    it on as it came, and it is then told apart from their own (``_Decompressed``)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.error: BaseException | None = None

    def read(self, size: int = -1) -> bytes:
        try:
            return self._raw.read(size)
        except BaseException as e:
            self.error = e
            raise


class _Decompressed(io.RawIOBase):
    """The decompressed bytes of one file, for io.BufferedReader.

    Closing closes the codec's stream and the file under it (fsspec's gzip, bz2 and xz codecs
    leave that file open). Codec errors become CorruptInputErrors naming the file; a read of
    the file itself that failed (the object store out of reach, 503 SlowDown after the
    client's retries) keeps its type, named the same way: as corrupt data it exited 2,
    "rerunning does not help", for an outage a rerun gets past (an audit).
    """

    def __init__(
        self, url: str, codec: str, stream: Any, source: _SourceReads, raw: IO[bytes]
    ) -> None:
        self._url = url
        self._codec = codec
        self._stream = stream
        self._source = source
        self._raw = raw
        self._done = 0  # decompressed bytes handed out so far

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            n = self._stream.readinto(buffer)
        except Exception as e:
            if e is self._source.error:
                raise _read_failed(self._url, self._done, e) from e
            raise CorruptInputError(
                f"{self._url}: {self._codec} decompression failed after {self._done} bytes "
                f"({type(e).__name__}: {e}); the file may be truncated or corrupt"
            ) from e
        self._done += n
        return n

    def close(self) -> None:
        if not self.closed:
            try:
                self._stream.close()
            finally:
                self._raw.close()
        super().close()


def _read_failed(url: str, done: int, exc: Exception) -> Exception:
    """The error of a read of ``url`` (``done`` decompressed bytes in) that failed with
    ``exc``: ``read_failed``'s for an OSError, else a StorageError (a store client's own
    exception types), naming the file."""
    if isinstance(exc, OSError):
        return read_failed(url, exc)
    return StorageError(f"{url}: reading failed after {done} bytes ({type(exc).__name__}: {exc})")


class _Streamed(io.RawIOBase):
    """A file that reads but cannot seek, for io.BufferedReader; closing closes it."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._raw.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a zstd file, frame after frame; EOFError when the file
    ends inside a frame (truncated)."""

    _CHUNK = 1 << 16  # compressed bytes read at a time

    def __init__(self, raw: IO[bytes]) -> None:
        import zstandard

        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._raw = raw
        self._out = b""  # decompressed, from ``_at`` on not yet handed out
        self._at = 0
        self._inside = False  # some of the current frame was fed
        self._ended = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._at == len(self._out) and not self._ended:
            chunk = self._raw.read(self._CHUNK)
            if not chunk:
                if self._inside:
                    raise EOFError("the file ends inside a zstd frame")
                self._ended = True
                break
            self._out, self._at = self._feed(chunk), 0
        n = min(len(buffer), len(self._out) - self._at)
        buffer[:n] = self._out[self._at : self._at + n]
        self._at += n
        return n

    def _feed(self, data: bytes) -> bytes:
        """Decompress ``data``, starting new frames where one ends."""
        out = []
        while data:
            out.append(self._frame.decompress(data))
            self._inside = True
            if not self._frame.eof:
                break
            data = self._frame.unused_data
            self._frame = self._decompressor.decompressobj()
            self._inside = False
        return b"".join(out)
