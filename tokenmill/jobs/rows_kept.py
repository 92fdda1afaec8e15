"""What a failed run leaves committed, carried on its exception to run-job's last line.

run-job ended every failure with "committed shards are kept; rerun the same command to
resume", also where nothing had been committed (the first shard's write failed: an audit),
which told a user progress was safe that did not exist. The runner knows the rows its
output holds once it has the manifest; it marks the exception with them, and run-job says
what is true: rows kept and resumed, or nothing committed yet.
"""

from __future__ import annotations

__all__ = ["mark_rows_kept", "rows_kept", "resume_advice"]

_ATTR = "tokenmill_rows_kept"


def mark_rows_kept(exc: BaseException, rows: int) -> None:
    """Record on ``exc`` that the output holds ``rows`` committed rows (every run's) as the
    run ends with it; an exception that takes no attributes is left unmarked."""
    try:
        setattr(exc, _ATTR, rows)
    except (AttributeError, TypeError):
        pass


def rows_kept(exc: BaseException) -> int | None:
    """The committed rows ``mark_rows_kept`` recorded on ``exc``; None where unknown (the
    run failed before it read the output's manifest)."""
    rows = getattr(exc, _ATTR, None)
    return rows if isinstance(rows, int) else None


def resume_advice(rows: int | None) -> str:
    """What a rerun does, for an output holding ``rows`` committed rows (None: unknown)."""
    if rows is None:
        return "committed shards are kept; rerun the same command to resume"
    if rows == 0:
        return "nothing was committed yet; rerun the same command to resume from the start"
    return f"the {rows:,} committed rows are kept; rerun the same command to resume"
