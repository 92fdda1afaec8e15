"""Encoding a whole shard so that no single row can fail the commit.

    results ─► encode_results(all good rows) ── ok ──► data bytes
                 └─ raises: encode each good row alone; the ones that fail become error rows
             ─► encode_errors(failed rows) ── raises: the same rows with every text field made
                                               writable (lone surrogates escaped)

A row whose fields cannot be written in the output format (a value Arrow cannot hold or that
does not fit the job's Parquet schema, text that is not valid Unicode) is thus a row error
naming the reason, never a job crash that would repeat on every rerun.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.rows import ResultRow
from tokenmill.io.writers import encode_errors, encode_results

__all__ = ["EncodedShard", "encode_shard", "writable_text"]


@dataclass(frozen=True)
class EncodedShard:
    data: bytes
    errors: bytes
    ok_rows: list[ResultRow]
    error_rows: list[ResultRow]


def encode_shard(
    results: list[ResultRow], fmt: str, schema: OutputSchema | None = None
) -> EncodedShard:
    """The data and error files of one shard; ``schema`` is the job's Parquet schema (see
    ``encode_results``). ``errors`` is empty when no row failed. Raises only for an unknown
    ``fmt``."""
    ok = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    try:
        data = encode_results(ok, fmt, schema=schema)
    except Exception:  # of any row: find which ones (Arrow's errors are of several kinds)
        ok, unwritable = _split_writable(ok, fmt, schema)
        bad += unwritable
        data = encode_results(ok, fmt, schema=schema)
    try:
        errors = encode_errors(bad, fmt)
    except Exception:
        bad = [_writable_error(r) for r in bad]
        errors = encode_errors(bad, fmt)
    return EncodedShard(data, errors, ok, sorted(bad, key=lambda r: r.row_index))


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
