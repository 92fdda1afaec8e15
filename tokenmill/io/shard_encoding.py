"""Writing a shard's data file, and encoding its error file, so that no single row can fail
the commit.

    results ─► write_results(all good rows) into store.writing(data file) ── ok ──► committed
                 └─ raises (nothing committed): encode each good row alone; the ones that
                    fail become error rows, the others are written again
             ─► encode_errors(failed rows) ── raises: the same rows with every text field made
                                               writable (lone surrogates escaped)

A row whose fields cannot be written in the output format (a value Arrow cannot hold or that
does not fit the job's Parquet schema, text that is not valid Unicode) is thus a row error
naming the reason, never a job crash that would repeat on every rerun. The data file is
streamed into the store (``OutputStore.writing``), never encoded in memory whole: a shard of
wide rows held it three more times over (its lines, their join and its bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.rows import ResultRow
from tokenmill.io.storage import OutputStore
from tokenmill.io.writers import encode_errors, encode_results, write_results

__all__ = ["WrittenShard", "write_shard", "writable_text"]


@dataclass(frozen=True)
class WrittenShard:
    data_bytes: int | None  # the committed data file's size; None: none was written
    errors: bytes  # the error file, for the caller to commit after the data file
    ok_rows: list[ResultRow]
    error_rows: list[ResultRow]


def write_shard(
    store: OutputStore,
    data_name: str,
    results: list[ResultRow],
    fmt: str,
    schema: OutputSchema | None = None,
) -> WrittenShard:
    """Commit the good rows of ``results`` as ``data_name`` in ``store`` and encode the error
    file of the others. ``fmt`` is one of ``OUTPUT_FORMATS`` (``shard_names`` checked it);
    ``schema`` is the job's Parquet schema (see ``write_results``). A Parquet data file is
    always written (it holds the schema), a JSON Lines one only for good rows (an empty one
    is refused by readers: see shard_commit.py). ``errors`` is empty when no row failed.
    Raises the store's OSError when the data file cannot be written."""
    ok = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    try:
        data_bytes = _write_data(store, data_name, ok, fmt, schema)
    except OSError:  # the store's failure, not a row's
        raise
    except Exception:  # of any row: find which ones (Arrow's errors are of several kinds)
        ok, unwritable = _split_writable(ok, fmt, schema)
        bad += unwritable
        data_bytes = _write_data(store, data_name, ok, fmt, schema)
    try:
        errors = encode_errors(bad, fmt)
    except Exception:
        bad = [_writable_error(r) for r in bad]
        errors = encode_errors(bad, fmt)
    return WrittenShard(data_bytes, errors, ok, sorted(bad, key=lambda r: r.row_index))


def _write_data(
    store: OutputStore, name: str, rows: list[ResultRow], fmt: str, schema: OutputSchema | None
) -> int | None:
    if not rows and fmt != "parquet":
        return None
    with store.writing(name) as out:
        write_results(rows, fmt, out, schema=schema)
        size = out.tell()
    return size


def _split_writable(
    rows: list[ResultRow], fmt: str, schema: OutputSchema | None
) -> tuple[list[ResultRow], list[ResultRow]]:
    ok, bad = [], []
    for row in rows:
        try:
            encode_results([row], fmt, schema=schema)
            ok.append(row)
        except Exception as exc:
            reason = f"the result cannot be written as {fmt}: {type(exc).__name__}: {exc}"
            where = f"{row.source}: " if row.source else ""
            bad.append(replace(row, error=writable_text(where + reason)))
    return ok, bad


def _writable_error(row: ResultRow) -> ResultRow:
    """``row`` with the text fields an error file holds escaped: it must always be written."""
    return replace(
        row,
        row_id=writable_text(row.row_id),
        custom_id=None if row.custom_id is None else writable_text(row.custom_id),
        error=writable_text(row.error or "unknown error"),
    )


def writable_text(text: str) -> str:
    """``text`` with lone surrogates (not valid Unicode, not encodable as UTF-8) written as
    ``\\udXXX`` escapes; other text unchanged."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
