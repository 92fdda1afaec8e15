"""JsonlRecords: stream a JSON Lines file line by line, whatever its size or compression."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import IO, Any

from tokenmill.io.readers.compression import open_input
from tokenmill.io.readers.record import Record
from tokenmill.io.readers.storage import is_read_error, read_failed

# How many lines to look through for the first JSON object when deciding which columns
# the file has; a file that starts with more unreadable lines than this is treated as
# having none.
_PEEK_LINES = 1000

# Characters of the line shown either side of a JSON error's position.
_EXCERPT_HALF = 10

_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark, which some editors write (and never show)


class JsonlRecords:
    """An open JSONL file; iterate it for Records, one per non-blank line.

    Blank lines are skipped but keep their line numbers, so ``position`` is the line an editor
    shows. Use as a context manager; the file is read through fsspec in blocks, never whole,
    and decompressed on the fly when compressed (see ``compression.open_input``).
    ``peek``: only the first lines are looked at (``keys_seen``): fetched in small blocks
    (``open_input``'s peek), not the whole blocks a read through the file wants.
    """

    def __init__(self, url: str, storage_options: dict[str, Any], peek: bool = False) -> None:
        self.url = url
        self._storage_options = storage_options
        self._peek = peek
        self._file: IO[bytes] | None = None
        self._fresh = False  # _file is at its first byte, nothing read from it yet
        self._first_keys: frozenset[str] | None = None

    def __enter__(self) -> JsonlRecords:
        self._file = open_input(self.url, self._storage_options, self._peek)
        self._fresh = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def has_column(self, name: str) -> bool:
        """Whether the file's first JSON object has key ``name`` (JSONL has no schema)."""
        if self._first_keys is None:
            self._first_keys = self._peek_first_keys()
        return name in self._first_keys

    def columns_hint(self) -> str:
        return ""

    def keys_seen(self) -> tuple[frozenset[str], int]:
        """(The keys of any of the file's first ``_PEEK_LINES`` JSON objects, how many
        objects that is): what a check of configured column names can go by."""
        keys: set[str] = set()
        objects = 0
        for value in self._first_objects():
            keys.update(value)
            objects += 1
        return frozenset(keys), objects

    def __iter__(self) -> Iterator[Record]:
        f = self._from_start()
        lines = enumerate(f, start=1)
        while True:
            try:
                line_no, raw = next(lines)
            except StopIteration:
                return
            except Exception as e:
                if is_read_error(e):  # the store's or the disk's: name the file read
                    raise read_failed(self.url, e) from e
                raise
            if not blank_line(raw, line_no):
                yield _decode(line_no, raw)

    def _peek_first_keys(self) -> frozenset[str]:
        return next((frozenset(value) for value in self._first_objects()), frozenset())

    def _first_objects(self) -> Iterator[dict[str, Any]]:
        """The JSON objects among the file's first ``_PEEK_LINES`` lines."""
        for record in self:
            if record.position > _PEEK_LINES:
                return
            if isinstance(record.value, dict):
                yield record.value

    def _from_start(self) -> IO[bytes]:
        """The open file at its first byte: as opened, seeked back, or reopened when it is a
        decompressing stream, which cannot seek backwards."""
        if self._file is None:
            raise RuntimeError(f"JsonlRecords({self.url!r}) used outside its 'with' block")
        if self._fresh:
            self._fresh = False
        elif self._file.seekable():
            self._file.seek(0)
        else:
            self._file.close()
            self._file = open_input(self.url, self._storage_options, self._peek)
        return self._file


def blank_line(raw: bytes, line_no: int) -> bool:
    """Whether JSONL line ``line_no`` (from 1) holds nothing: white space, or on line 1 a
    byte-order mark and white space (such lines are no rows)."""
    if line_no == 1:
        raw = raw.removeprefix(_BOM)
    return not raw.strip()


def _decode(line_no: int, raw: bytes) -> Record:
    # A byte-order mark starts any line, not only line 1: files joined with ``cat`` keep
    # each one's mark, and json reads a line starting with one as "expecting value at
    # column 1" (a good row refused for a character no editor shows). No JSON value starts
    # with U+FEFF, so dropping it changes no line's meaning.
    marked = raw.startswith(_BOM)
    try:
        text = raw[len(_BOM) :].decode("utf-8") if marked else raw.decode("utf-8")
    except UnicodeDecodeError as e:
        start = e.start + len(_BOM) if marked else e.start
        return Record(line_no, error=f"line is not valid UTF-8 ({e.reason} at byte {start})")
    if marked and not text.strip():
        # (still a row, as it was: a blank line here would renumber the rows after it,
        # and a resumed run would take its committed shards for other rows)
        return Record(
            line_no,
            error="line holds only a byte-order mark (U+FEFF), as where files were joined "
            "with cat; delete the line",
        )
    # Without its line break, an unterminated string reads as one, not as a control character.
    text = text.rstrip("\r\n")
    try:
        return Record(line_no, value=_DECODER.decode(text))
    except _DuplicateKeyError as e:
        return Record(line_no, error=f"line is ambiguous JSON: {e}")
    except json.JSONDecodeError as e:
        return Record(line_no, error=f"line is not valid JSON: {_json_error(e, text)}")
    except RecursionError:
        return Record(line_no, error="line is nested too deeply to read (over ~1000 levels)")
    except ValueError as e:  # an integer of more than 4,300 digits
        return Record(line_no, error=f"line cannot be read: {e}")


class _DuplicateKeyError(ValueError):
    """One JSON object holds a key twice."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The dict of one JSON object's ``pairs``; _DuplicateKeyError when a key repeats.

    JSON leaves the meaning of a repeated key open: Python keeps the last value, other
    readers the first. A row such as ``{"id": "a", "prompt": "x", "id": "b"}`` has no one
    meaning, so it is a bad row naming the key rather than a guess without a word.
    """
    value = dict(pairs)
    if len(value) < len(pairs):
        twice = next(key for key, n in Counter(key for key, _ in pairs).items() if n > 1)
        raise _DuplicateKeyError(
            f"key {twice!r} appears twice in one object (which value is meant is not "
            "defined); keep one of them"
        )
    return value


# json.loads(text, object_pairs_hook=_object), without building a decoder a line (a fifth of
# a line's decode)
_DECODER = json.JSONDecoder(object_pairs_hook=_object)


def _json_error(e: json.JSONDecodeError, text: str) -> str:
    """What is wrong, where, and the text there, for any JSONDecodeError of one line ``text``.

    The column counts characters (not bytes) from 1, as an editor shows it; the line holds no
    line break, so ``e.pos`` is the column less one. json's messages that end in " at"
    ("Unterminated string starting at") expect a position after them: the column, here.
    """
    what = e.msg.removesuffix(" at")
    what = what[:1].lower() + what[1:]
    start = max(0, e.pos - _EXCERPT_HALF)
    excerpt = text[start : e.pos + _EXCERPT_HALF]
    return f"{what} at column {e.pos + 1}, near {excerpt!r}"
