"""iter_input_rows: every row of every input file, in order, as InputRows; bad rows included.

    files (sorted) ─► JsonlRecords | ParquetRecords ─► Record ─► parse ─► duplicate check
                           ─► writable? ─► passthrough values fit the job's schema? (if given)
                                                                          ─► InputRow(row_index)
                                           └─ id_only(row_index) ─► its id taken ─► IdOnlyRow

A resumed job needs of its committed shards' rows only what they do to the ids of the rows
after them (a later row with an earlier row's id is a duplicate; bad rows' stand-ins
``<file>:<line>#2`` skip ids taken): ``id_only`` rows are read for that alone, about four
times faster than in full (bench/resume_skim.py), and come out as ``IdOnlyRow``.

``row_index`` counts every row of the whole input, bad ones included (blank JSONL lines are not
rows), so it is stable across runs and shards can be defined as row-index ranges.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, overload

from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.readers.file_listing import display_names, list_input_files
from tokenmill.io.readers.format_detection import input_format
from tokenmill.io.readers.input_config import DEFAULT_ID_COLUMN, InputConfig
from tokenmill.io.readers.jsonl_records import JsonlRecords
from tokenmill.io.readers.openai_batch_rows import batch_row_id, parse_openai_batch_row
from tokenmill.io.readers.openai_sampling import CHAT, COMPLETIONS
from tokenmill.io.readers.parquet_records import ParquetRecords
from tokenmill.io.readers.plain_rows import PlainColumns, parse_plain_row, plain_row_id
from tokenmill.io.readers.record import Record, RecordSource
from tokenmill.io.readers.row_error import RowError
from tokenmill.io.readers.text_check import unwritable_field, writable_text
from tokenmill.io.rows import InputRow
from tokenmill.io.url_secrets import hide_url_secrets

log = logging.getLogger("tokenmill.jobs")

Parse = Callable[[Any, int, str, str], InputRow]  # (value, row_index, source, fallback_id)
IdOf = Callable[[Any, str], str]  # (value, fallback_id): the id Parse reads first, or RowError
RowPredicate = Callable[[int], bool]  # of a row_index


@dataclass(frozen=True)
class IdOnlyRow:
    """A row read for its id alone (``iter_input_rows``'s ``id_only``): the ids it takes are
    taken as a full read would take them; nothing else of it is checked or kept."""

    row_index: int


@overload
def iter_input_rows(cfg: InputConfig, schema: OutputSchema | None = None) -> Iterator[InputRow]: ...


@overload
def iter_input_rows(
    cfg: InputConfig, schema: OutputSchema | None = None, *, id_only: RowPredicate | None
) -> Iterator[InputRow | IdOnlyRow]: ...


Check = Callable[[InputRow], str | None]  # why a parsed row cannot be written, or None


def iter_input_rows(
    cfg: InputConfig, schema: OutputSchema | None = None, *, id_only: RowPredicate | None = None
) -> Iterator[InputRow | IdOnlyRow]:
    """Stream the input of ``cfg`` as InputRows, ``row_index`` 0, 1, 2, ... across all files.

    Bad rows (not JSON, not an object, missing id or prompt, invalid messages or parameters,
    repeated id, and with ``schema`` (the job's Parquet output schema) a passthrough value
    that does not fit its column's type) come out as ``InputRow(error=...)`` and never stop
    the stream. Ids must be unique over the whole input: the first row with an id keeps it,
    later ones are bad. Memory stays bounded by one line or one Parquet batch, plus the set
    of ids seen so far (about 100 bytes per row).
    A row whose index ``id_only`` holds for comes out as an ``IdOnlyRow``: only its id is
    read, and the rows after it come out exactly as in a full read (its id taken, or its
    stand-in).
    Raises FileNotFoundError / ValueError naming the path for a missing or unreadable input.
    """
    files = list_input_files(cfg)
    fmt = input_format(cfg, files)
    if fmt != "openai-batch":
        cfg.check_plain_columns()
    ids = _Ids()
    row_index = 0
    for url, name in zip(files, display_names(files), strict=True):
        with _open_source(url, fmt, cfg) as source:
            maker = _RowMaker(
                hide_url_secrets(url),  # the rows' sources name the file, never a password
                name,
                *_parser(fmt, cfg, source),
                fmt == "openai-batch",
                cfg.passthrough_columns,
                _passthrough_check(schema, source),
            )
            for record in source:
                if id_only is not None and id_only(row_index):
                    maker.take_id(record, row_index, ids)
                    yield IdOnlyRow(row_index)
                else:
                    yield maker.row(record, row_index, ids)
                row_index += 1


@dataclass
class _Ids:
    """The ids given out so far: rows' own (an id column's, or the fallback of a row that
    has none), and the fallbacks given to bad rows in place of an id they could not keep.
    Only the first count as taken for a later row's own id: a bad row's stand-in never
    costs a later row its output (a row whose own id was "in.jsonl:2" was refused as a
    duplicate, that being the stand-in of the bad row at line 2)."""

    own: set[str] = field(default_factory=set)
    stand_ins: set[str] = field(default_factory=set)

    def stand_in(self, base: str) -> str:
        """``base``, or ``base#2``, ``base#3``, ... where it is taken (either way)."""
        free, n = base, 1
        while free in self.own or free in self.stand_ins:
            n += 1
            free = f"{base}#{n}"
        self.stand_ins.add(free)
        return free

    def claim(self, own_id: str | None, fallback_id: str) -> tuple[str | None, str]:
        """A bad row's ids: (``own_id``, ``fallback_id``) where ``own_id`` is free (it is
        taken), else (None, a stand-in of ``fallback_id``)."""
        if own_id is not None and own_id not in self.own:
            self.own.add(own_id)
            return own_id, fallback_id
        return None, self.stand_in(fallback_id)


def _open_source(url: str, fmt: str, cfg: InputConfig) -> JsonlRecords | ParquetRecords:
    if fmt == "parquet":
        wanted = [cfg.id_column, cfg.prompt_column, cfg.messages_column, *cfg.passthrough_columns]
        wanted.append(cfg.structured_output_column)
        return ParquetRecords(url, cfg.storage_options, [c for c in wanted if c is not None])
    return JsonlRecords(url, cfg.storage_options)


def _passthrough_check(schema: OutputSchema | None, source: RecordSource) -> Check | None:
    """Whether a row's passthrough values fit ``schema``; columns a Parquet file holds in
    the schema's own type need no look (their values came out of that type)."""
    if schema is None or not schema.passthrough:
        return None
    same: frozenset[str] = frozenset()
    if isinstance(source, ParquetRecords):
        types = source.column_types()
        same = frozenset(f.name for f in schema.passthrough if types.get(f.name) == f.type)
        if len(same) == len(schema.passthrough):
            return None

    def check(row: InputRow) -> str | None:
        return schema.row_problem(row.passthrough, same)

    return check


def _parser(fmt: str, cfg: InputConfig, source: RecordSource) -> tuple[Parse, IdOf]:
    """How the rows of ``source`` are parsed, and how their ids alone are read."""
    if fmt == "openai-batch":
        passthrough = cfg.passthrough_columns

        def parse_batch(value: Any, row_index: int, source: str, fallback_id: str) -> InputRow:
            return parse_openai_batch_row(
                value, passthrough_columns=passthrough, row_index=row_index, source=source
            )

        return parse_batch, lambda value, fallback_id: batch_row_id(value)
    columns = PlainColumns.for_file(cfg, source.has_column, source.columns_hint())
    if columns.id_column is None and cfg.id_column == DEFAULT_ID_COLUMN:
        _warn_of_an_id_in_other_case(source)

    def parse_plain(value: Any, row_index: int, source: str, fallback_id: str) -> InputRow:
        return parse_plain_row(
            value, columns=columns, row_index=row_index, source=source, fallback_id=fallback_id
        )

    def plain_id(value: Any, fallback_id: str) -> str:
        return plain_row_id(value, columns=columns, fallback_id=fallback_id)

    return parse_plain, plain_id


_WARNED_ID_CASE: set[str] = set()  # files warned about, once a process (rows are read more
# than once a job: the passthrough sample, the dry run, the run)


def _warn_of_an_id_in_other_case(source: RecordSource) -> None:
    """A file without the default ``id`` column but with ``ID`` (or ``Id``, ``iD``) gets
    "<file>:<row>" ids: say so, naming the column, rather than let its ids go unused."""
    found = next((name for name in ("ID", "Id", "iD") if source.has_column(name)), None)
    if found is None:
        return
    url = hide_url_secrets(source.url)
    if url in _WARNED_ID_CASE:
        return
    if len(_WARNED_ID_CASE) > 10_000:
        _WARNED_ID_CASE.clear()
    _WARNED_ID_CASE.add(url)
    log.warning(
        "%s has no 'id' column but has %r (names are case-sensitive): its rows get "
        "'<file>:<row>' ids; set input.id_column: %s to keep its ids",
        url,
        found,
        found,
    )


@dataclass(frozen=True)
class _RowMaker:
    """Builds the InputRow of each Record of one file: parse, then the duplicate check."""

    url: str  # as shown: a password in it masked
    name: str  # the file's display name, for fallback ids
    parse: Parse
    id_of: IdOf
    batch: bool  # OpenAI Batch input: error rows carry custom_id and endpoint
    passthrough_columns: tuple[str, ...]
    check: Check | None = None

    def row(self, record: Record, row_index: int, ids: _Ids) -> InputRow:
        """The row of ``record``; a bad one carries ``error`` (without its location: the
        error file adds ``source`` once). A bad row claims its id (a later row with it is a
        duplicate, not a fix); an id already taken is never reused by an error row: one
        without an id of its own takes its fallback ``<file>:<line>``, or where an earlier
        row took that, the fallback with ``#2``, ``#3``, ... after it (``_Ids``)."""
        source = f"{self.url}:{record.position}"
        fallback_id = f"{self.name}:{record.position}"
        if record.error is not None and record.value is None:
            return InputRow(row_index, ids.stand_in(fallback_id), source, error=record.error)

        def refuse(reason: str, own_id: str | None) -> InputRow:
            if own_id is not None and own_id in ids.own:
                reason += f" (its id {own_id!r} is also an earlier row's)"
            own_id, free = ids.claim(own_id, fallback_id)
            return self._bad_row(record.value, reason, own_id, row_index, source, free)

        if record.error is not None:  # a value Python cannot hold: the row's own id if it has one
            return refuse(record.error, self._own_id(record.value, row_index, source, fallback_id))
        try:
            row = self.parse(record.value, row_index, source, fallback_id)
        except RowError as e:
            return refuse(str(e), e.row_id)
        except Exception as e:  # any surprise in a row is that row's error, never the job's;
            # it keeps the id read before it, as a RowError past the id would
            own_id = self._id_or_none(record.value, fallback_id)
            return refuse(f"the row could not be read ({type(e).__name__}: {e})", own_id)
        if row.row_id in ids.own:
            return refuse(
                f"duplicate id {row.row_id!r}: an earlier row already has it; "
                "ids must be unique across all input files",
                None,
            )
        unwritable = unwritable_field(row)
        if unwritable is not None:
            own_id = None if unwritable.startswith(("id ", "custom_id ")) else row.row_id
            return refuse(f"{unwritable}; fix the row", own_id)
        misfit = self.check(row) if self.check is not None else None
        if misfit is not None:
            return refuse(misfit, row.row_id)
        ids.own.add(row.row_id)
        return row

    def take_id(self, record: Record, row_index: int, ids: _Ids) -> None:
        """What ``row`` does to ``ids``, reading the row's id alone. Every way through
        ``row`` ends in ``ids.claim`` of the id ``id_of`` reads (a RowError past the id
        carries it, a surprise past it keeps it, and a good row's free id is taken as a bad
        row's is) or of None (no id to read, or one taken), but two: a Parquet row with a
        value Python cannot hold, and an id that cannot be written (a good row gives it up, a
        bad one keeps it); both rare, and read in full here."""
        fallback_id = f"{self.name}:{record.position}"
        if record.error is not None and record.value is not None:
            self.row(record, row_index, ids)
            return
        own_id = None if record.error is not None else self._id_or_none(record.value, fallback_id)
        if own_id is not None and not writable_text(own_id):
            self.row(record, row_index, ids)
            return
        ids.claim(own_id, fallback_id)

    def _own_id(self, value: Any, row_index: int, source: str, fallback_id: str) -> str | None:
        """The id the row ``value`` gives itself, or None when it cannot be read."""
        try:
            row = self.parse(value, row_index, source, fallback_id)
        except RowError as e:
            return e.row_id
        except Exception:
            return None
        return None if row.row_id == fallback_id else row.row_id

    def _id_or_none(self, value: Any, fallback_id: str) -> str | None:
        """The id of the row ``value`` (``id_of``), or None when it has none it can keep."""
        try:
            return self.id_of(value, fallback_id)
        except Exception:
            return None

    def _bad_row(
        self,
        value: Any,
        reason: str,
        own_id: str | None,
        row_index: int,
        source: str,
        fallback_id: str,
    ) -> InputRow:
        # Keep what the error file may echo: passthrough columns, custom_id, endpoint.
        passthrough: dict[str, Any] = {}
        endpoint = None
        if isinstance(value, dict):
            passthrough = {name: value.get(name) for name in self.passthrough_columns}
            if self.batch and value.get("url") in (CHAT, COMPLETIONS):
                endpoint = value["url"]
        return InputRow(
            row_index,
            own_id or fallback_id,
            source,
            passthrough=passthrough,
            custom_id=own_id if self.batch else None,
            endpoint=endpoint,
            error=reason,
        )
