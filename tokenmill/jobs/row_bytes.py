"""row_bytes: about how much host memory a row holds, so that queues of rows can be bounded
in bytes as well as in rows.

Bounds in rows alone hold a whole input when its rows are wide: 400 rows with a 5 MB
passthrough column each reached 5.6 GB of RSS, the rows waiting in the read-ahead queue,
the reader's batch and the planner's window (an audit). The estimate is what a row's values
weigh (characters of text, items of containers, token ids), not ``sys.getsizeof`` over
every object: walking a row's values once is cheap next to parsing them, and a bound within
a small factor is all a queue needs.
"""

from __future__ import annotations

from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.io.value_bytes import value_bytes
from tokenmill.jobs.ready_rows import ReadyRow
from tokenmill.jobs.row_source import FeedItem

__all__ = ["input_row_bytes", "item_bytes"]

_ROW_BYTES = 256  # a row's own objects: its dataclass, id, source, sampling dict
_TOKEN_BYTES = 36  # a token id in a list: the reference and its int object


def input_row_bytes(row: InputRow) -> int:
    """About the bytes ``row`` holds: its prompt (text, messages or token ids), its
    passthrough values and its per-row settings."""
    total = _ROW_BYTES + value_bytes(row.passthrough)
    if row.prompt is not None:
        total += len(row.prompt)
    if row.messages is not None:
        total += value_bytes(row.messages)
    if row.prompt_token_ids is not None:
        total += _TOKEN_BYTES * len(row.prompt_token_ids)
    if row.sampling:
        total += value_bytes(row.sampling)
    if row.chat_template_kwargs:
        total += value_bytes(row.chat_template_kwargs)
    return total


def item_bytes(item: FeedItem, row_bytes: int) -> int:
    """About the bytes feed ``item`` holds, given ``row_bytes`` (``input_row_bytes`` of the
    row it was made from): a prepared row adds its token ids; a row that failed while
    prepared keeps its passthrough values in its result."""
    if isinstance(item, ReadyRow):
        return row_bytes + _TOKEN_BYTES * len(item.prompt_ids)
    if isinstance(item, ResultRow):
        return row_bytes + len(item.error or "")
    return row_bytes
