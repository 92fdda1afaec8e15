"""How long a resumed job reads before its first new row: the rows of committed shards read
in full (every check, an InputRow each) or for their ids alone (``iter_input_rows``'s
``id_only``).

Writes ``--rows`` chat rows (JSONL, a system and a user message each) to a temporary file,
commits the first ``--committed`` of them (whole shards of ``--shard-rows``), then reads the
input as a resume does and prints the seconds to the first row of an uncommitted shard and
to the input's end, for each way.

    PYTHONPATH=. .venv/bin/python bench/resume_skim.py [--rows 200000] [--committed 0.9]
        [--shard-rows 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from tokenmill.io.readers import InputConfig, iter_input_rows


def write_chat_rows(path: str, rows: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            messages = [
                {"role": "system", "content": "You are a careful assistant. Answer briefly."},
                {"role": "user", "content": f"Summarise item {i}: " + "lorem ipsum " * 20},
            ]
            f.write(json.dumps({"id": f"row-{i}", "messages": messages, "topic": i % 7}) + "\n")


def time_read(cfg: InputConfig, first_new: int, id_only: Callable[[int], bool] | None) -> tuple:
    """(seconds to the first row at ``first_new``, seconds to the end, rows seen)."""
    start = time.perf_counter()
    first = None
    seen = 0
    rows = iter_input_rows(cfg) if id_only is None else iter_input_rows(cfg, id_only=id_only)
    for row in rows:
        seen += 1
        if first is None and row.row_index >= first_new and getattr(row, "row_id", None):
            first = time.perf_counter() - start
    return first, time.perf_counter() - start, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--committed", type=float, default=0.9)
    parser.add_argument("--shard-rows", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--full-only", action="store_true", help="code without id_only")
    args = parser.parse_args()
    shards = int(args.rows * args.committed) // args.shard_rows
    committed = frozenset(range(shards))
    first_new = shards * args.shard_rows

    def skip(i: int) -> bool:
        return i // args.shard_rows in committed

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "chat.jsonl")
        write_chat_rows(path, args.rows)
        cfg = InputConfig(
            path=path,
            prompt_column=None,
            messages_column="messages",
            passthrough_columns=("topic",),
        )
        ways = {"full read": None} if args.full_only else {"full read": None, "id_only": skip}
        print(
            f"{args.rows:,} chat rows, {len(committed)} of {-(-args.rows // args.shard_rows)} "
            f"shards committed (first new row {first_new:,})"
        )
        for name, id_only in ways.items():
            runs = [time_read(cfg, first_new, id_only) for _ in range(args.repeats)]
            first = statistics.median(r[0] for r in runs)
            total = statistics.median(r[1] for r in runs)
            print(
                f"  {name:10s} first new row {first:6.3f} s   whole read {total:6.3f} s   "
                f"({runs[0][2]:,} items)"
            )


if __name__ == "__main__":
    main()
