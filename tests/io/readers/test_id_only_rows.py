"""iter_input_rows's ``id_only``: rows read for their ids alone leave every later row, and
the ids taken, exactly as a full read does (a fuzz over bad rows of every kind)."""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.io.output_schema import OutputSchema
from tokenmill.io.readers import IdOnlyRow, InputConfig, iter_input_rows
from tokenmill.io.readers import input_rows as input_rows_module

GOOD_MESSAGES = [{"role": "user", "content": "hi"}]
DEEP = "[" * 5000  # JSON text nested past the recursion limit: a parse's surprise


def _plain_line(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.04:
        return rng.choice([b"{not json", b"42", b'["a"]', b"\xff\xfe{}", b"   "])
    if kind < 0.07:
        return b'{"id": "a", "id": "b", "messages": []}'  # ambiguous JSON
    row: dict[str, Any] = {}
    if rng.random() < 0.4:
        row["id"] = f"u{rng.randrange(10**6)}"  # (a fresh id: a row that gets past the id)
    elif rng.random() < 0.85:
        row["id"] = rng.choice(
            ["a", "b", "c", "d", "e", 1, 2, 1.0, 2.5, None, "", True, {"x": 1}]
            + ["\ud800x", "in.jsonl:3", "in.jsonl:3#2", "b.jsonl:1", "1"]
        )
    if rng.random() < 0.95:
        row["messages"] = rng.choice(
            [GOOD_MESSAGES] * 4
            + [
                [],
                "hello",
                DEEP,
                [{"role": "user", "content": "\udc00"}],
                json.dumps(GOOD_MESSAGES),
            ]
        )
    row["topic"] = rng.choice([1, 2, 3, "text", "\ud801", None])
    return json.dumps(row).encode()  # (ensure_ascii: lone surrogates as \\ud800 escapes)


def _batch_line(rng: random.Random) -> bytes:
    if rng.random() < 0.05:
        return rng.choice([b"{not json", b"7"])
    line: dict[str, Any] = {
        "custom_id": rng.choice(["a", "b", "c", "", None, 5, "\ud800", "b.jsonl:2"]),
        "method": rng.choice(["POST"] * 5 + ["GET"]),
        "url": rng.choice(["/v1/chat/completions"] * 4 + ["/v1/completions", "/v1/other"]),
        "body": rng.choice(
            [{"messages": GOOD_MESSAGES}] * 3
            + [{"prompt": "x"}, {"messages": []}, {"messages": GOOD_MESSAGES, "n": 0}, "body"]
        ),
        "topic": rng.choice([1, "\ud800"]),
    }
    if rng.random() < 0.1:
        del line["custom_id"]
    return json.dumps(line).encode()


def _write_jsonl(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(line + b"\n" for line in lines))


def _read(cfg: InputConfig, schema: OutputSchema | None, id_only: Any, monkeypatch) -> tuple:
    """(what iter_input_rows yields, its final (own, stand_ins) ids)."""
    made: list[Any] = []

    class Recorded(input_rows_module._Ids):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(input_rows_module, "_Ids", Recorded)
    rows = list(iter_input_rows(cfg, schema, id_only=id_only))
    (ids,) = made
    return rows, (frozenset(ids.own), frozenset(ids.stand_ins))


def _assert_same_as_full(cfg: InputConfig, schema: OutputSchema | None, rng, monkeypatch):
    full, full_ids = _read(cfg, schema, None, monkeypatch)
    for _ in range(25):
        per_shard = rng.randint(1, 6)
        shards = -(-len(full) // per_shard)
        committed = frozenset(s for s in range(shards) if rng.random() < rng.random())

        def id_only(i: int, per_shard=per_shard, committed=committed) -> bool:
            return i // per_shard in committed

        rows, ids = _read(cfg, schema, id_only, monkeypatch)
        assert len(rows) == len(full)
        for got, want in zip(rows, full, strict=True):
            assert got == (IdOnlyRow(want.row_index) if id_only(want.row_index) else want)
        assert ids == full_ids


@pytest.mark.parametrize("seed", range(12))
def test_plain_jsonl_rows_after_id_only_ones_are_as_in_a_full_read(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    _write_jsonl(tmp_path / "a.jsonl", [_plain_line(rng) for _ in range(rng.randint(20, 60))])
    _write_jsonl(tmp_path / "b.jsonl", [_plain_line(rng) for _ in range(rng.randint(5, 30))])
    schema = OutputSchema.of([pa.field("topic", pa.int64())]) if seed % 2 else None
    for id_column in ("id", None):
        cfg = InputConfig(
            path=str(tmp_path),
            id_column=id_column,
            prompt_column=None,
            messages_column="messages",
            passthrough_columns=("topic",),
        )
        _assert_same_as_full(cfg, schema, rng, monkeypatch)


@pytest.mark.parametrize("seed", range(6))
def test_openai_batch_rows_after_id_only_ones_are_as_in_a_full_read(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    first = json.dumps(
        {"custom_id": "z", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    )
    lines = [first.encode()] + [_batch_line(rng) for _ in range(rng.randint(20, 60))]
    _write_jsonl(tmp_path / "b.jsonl", lines)
    cfg = InputConfig(path=str(tmp_path), format="openai-batch", passthrough_columns=("topic",))
    _assert_same_as_full(cfg, None, rng, monkeypatch)


@pytest.mark.parametrize("seed", range(6))
def test_parquet_rows_after_id_only_ones_are_as_in_a_full_read(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    n = rng.randint(20, 60)
    ids: list[Any] = [rng.choice([1.0, 2.0, 3.0, None, float("nan")]) for _ in range(n)]
    when = pa.array(
        [rng.choice([0, 2**62]) for _ in range(n)], pa.timestamp("us")
    )  # 2**62 us: past year 9999, a value Python cannot hold (the row's error, with its id)
    columns = {
        "id": ids,
        "prompt": [rng.choice(["p", "", None]) for _ in range(n)],
        "when": when,
        "u": [uuid.UUID(int=rng.randint(0, 3)).bytes for _ in range(n)],
    }
    pq.write_table(pa.table(columns), tmp_path / "a.parquet", row_group_size=7)
    pq.write_table(
        pa.table({"prompt": ["q"] * 9, "other": list(range(9))}), tmp_path / "b.parquet"
    )  # no id column: "<file>:<row>" ids
    cfg = InputConfig(path=str(tmp_path), passthrough_columns=("when",))
    _assert_same_as_full(cfg, None, rng, monkeypatch)
    cfg = InputConfig(path=str(tmp_path), id_column=None, passthrough_columns=("when",))
    _assert_same_as_full(cfg, None, rng, monkeypatch)
