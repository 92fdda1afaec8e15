"""Parquet rows: columns, 0-based row ids, messages as a list of structs, batching."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.io.readers.reader_files import read, summary, write_jsonl, write_parquet
from tokenmill.io.readers import parquet_records
from tokenmill.io.readers.compression import CorruptInputError


def test_rows_ids_and_passthrough(tmp_path):
    f = write_parquet(
        tmp_path / "in.parquet",
        {"id": [10, 11, None], "prompt": ["a", "b", "c"], "meta": ["m0", None, "m2"]},
    )
    rows = read(f, passthrough_columns=("meta", "absent"))
    assert summary(rows) == [(0, "10", True), (1, "11", True), (2, "in.parquet:2", False)]
    assert rows[0].prompt == "a" and rows[0].passthrough == {"meta": "m0", "absent": None}
    assert rows[1].source == f"{f}:1"
    assert "missing id" in rows[2].error and rows[2].source == f"{f}:2"


def test_no_id_column_gives_zero_based_row_ids_across_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(parquet_records, "PARQUET_BATCH_ROWS", 3)
    write_parquet(tmp_path / "a.parquet", {"prompt": [f"p{i}" for i in range(7)]}, 2)
    write_parquet(tmp_path / "b.parquet", {"prompt": ["q0", ""]})
    rows = read(tmp_path)
    assert [r.row_index for r in rows] == list(range(9))
    assert [r.row_id for r in rows[:8]] == [f"a.parquet:{i}" for i in range(7)] + ["b.parquet:0"]
    assert [r.prompt for r in rows[:7]] == [f"p{i}" for i in range(7)]
    assert "missing prompt" in rows[8].error


def test_messages_column_of_structs(tmp_path):
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())])
    table = pa.table(
        {
            "id": ["c1", "c2"],
            "messages": pa.array(
                [
                    [{"role": "system", "content": "Be brief.", "name": None},
                     {"role": "user", "content": "Hi", "name": "ann"}],
                    [{"role": "wizard", "content": "x", "name": None}],
                ],
                type=pa.list_(message),
            ),
        }
    )  # fmt: skip
    pq.write_table(table, tmp_path / "chat.parquet")
    rows = read(tmp_path / "chat.parquet", messages_column="messages")
    # Null struct fields are dropped: Parquet fills absent fields with nulls.
    assert rows[0].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ann"},
    ]
    assert rows[1].row_id == "c2" and "role is 'wizard'" in rows[1].error


def test_a_bad_conversation_reads_the_same_from_parquet_structs_and_jsonl(tmp_path):
    """The same bad messages give the same error whichever file holds them, indexes 0-based
    as in a JSON path; a role or a part's text left null was shown as Python's None, or as
    "not a text part (got type 'text')"."""
    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    message = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    conversations = [
        [{"role": "user", "content": [{"type": "text", "text": "a"}]},
         {"role": "user", "content": [{"type": "text", "text": None}]}],
        [{"role": None, "content": [{"type": "text", "text": "a"}]}],
    ]  # fmt: skip
    ids = ["t", "r"]
    table = pa.table({"id": ids, "messages": pa.array(conversations, type=pa.list_(message))})
    pq.write_table(table, tmp_path / "chat.parquet")
    lines = [{"id": i, "messages": m} for i, m in zip(ids, conversations, strict=True)]
    write_jsonl(tmp_path / "chat.jsonl", lines)
    from_parquet = read(tmp_path / "chat.parquet", messages_column="messages")
    from_jsonl = read(tmp_path / "chat.jsonl", messages_column="messages")
    assert [r.error for r in from_parquet] == [r.error for r in from_jsonl]
    assert (
        from_parquet[0].error == "column 'messages'[1].content[0].text must be a string, got null"
    )
    assert from_parquet[1].error.startswith("column 'messages'[0].role is null; expected one of")


def test_missing_prompt_column_lists_the_file_columns(tmp_path):
    f = write_parquet(tmp_path / "in.parquet", {"id": ["a"], "text": ["x"]})
    (row,) = read(f)
    assert "no column 'prompt'" in row.error and "id, text" in row.error


def test_unreadable_parquet_names_the_file(tmp_path):
    f = tmp_path / "broken.parquet"
    f.write_bytes(b"not parquet at all")
    try:
        read(f)
    except ValueError as e:
        assert str(f) in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_a_truncated_or_corrupt_parquet_file_is_corrupt_input(tmp_path):
    """Exit 2 ("rerunning as it is does not help"), as a truncated .gz; it was exit 1."""
    import pytest

    from tokenmill.io.readers.compression import CorruptInputError

    table = pa.table({"prompt": [f"p{i}" * 10 for i in range(20000)]})
    good = tmp_path / "good.parquet"
    pq.write_table(table, good, row_group_size=2000)
    data = good.read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2])
    spoiled = bytearray(data)
    spoiled[len(data) // 3 : len(data) // 3 + 4000] = bytes(4000)
    mid = tmp_path / "mid.parquet"
    mid.write_bytes(bytes(spoiled))
    for f in (cut, mid):
        with pytest.raises(CorruptInputError, match=str(f)):
            read(f)


def test_a_value_python_cannot_hold_is_its_rows_error_not_the_files(tmp_path, monkeypatch):
    """A timestamp past year 9999 raised out of the reader (exit 1 on every rerun); a
    time64[ns] value with nanoseconds was cut to microseconds without a word."""
    monkeypatch.setattr(parquet_records, "PARQUET_BATCH_ROWS", 4)
    stamps = [1_700_000_000_000] * 6
    stamps[4] = 10**15  # year 33658
    times = [1_000_000_000] * 6
    times[1] = 1_000_000_001
    table = pa.table({
        "id": [f"r{i}" for i in range(6)], "prompt": ["hi"] * 6,
        "when": pa.array(stamps, pa.timestamp("ms")), "at": pa.array(times, pa.time64("ns")),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "a.parquet")
    rows = read(tmp_path / "a.parquet", passthrough_columns=("when", "at"))
    # each bad row keeps its own id (it was the file's "a.parquet:4"), for joining errors back
    assert summary(rows) == [(i, f"r{i}", i not in (1, 4)) for i in range(6)]
    assert "column 'at' holds a time64[ns] value with nanoseconds" in rows[1].error
    assert "column 'when' holds a timestamp[ms] value Python cannot hold" in rows[4].error
    assert rows[5].passthrough["at"] == rows[0].passthrough["at"]


def test_a_nested_time64_ns_value_with_nanoseconds_is_its_rows_error(tmp_path):
    """Inside a struct, list or map, a time64[ns] value with nanoseconds was cut to
    microseconds without a word (only a top-level column was checked)."""
    ns, whole = 1_000_000_001, 2_000_000_000
    table = pa.table({
        "id": ["r0", "r1", "r2", "r3"], "prompt": ["hi"] * 4,
        "st": pa.array([{"t": whole}, {"t": ns}, None, {"t": whole}],
                       pa.struct([("t", pa.time64("ns"))])),
        "ls": pa.array([[whole], [whole], [whole, ns], None], pa.list_(pa.time64("ns"))),
        "mp": pa.array([[("a", whole)], None, None, [("b", ns)]],
                       pa.map_(pa.string(), pa.time64("ns"))),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "a.parquet")
    rows = read(tmp_path / "a.parquet", passthrough_columns=("st", "ls", "mp"))
    assert summary(rows) == [(i, f"r{i}", i == 0) for i in range(4)]
    for row, column in zip(rows[1:], ("st", "ls", "mp"), strict=True):
        assert f"column {column!r} holds a time64[ns] value with nanoseconds" in row.error
    assert rows[0].passthrough["st"] == {"t": dt.time(0, 0, 2)}


def test_a_zoned_timestamp_python_holds_only_in_utc_is_read(tmp_path):
    """9999-12-31T23:59:59Z, the usual open end, is in year 10000 in Berlin: the row was an
    error ("a value Python cannot hold") though Python holds the instant."""
    end = pa.array([253_402_300_799_000_000, 0], pa.timestamp("us", "Europe/Berlin"))
    start = pa.array([-62_135_596_800_000_000, 0], pa.timestamp("us", "America/New_York"))
    table = pa.table({"id": ["r0", "r1"], "prompt": ["hi"] * 2, "end": end, "start": start})
    pq.write_table(table, tmp_path / "a.parquet")
    rows = read(tmp_path / "a.parquet", passthrough_columns=("end", "start"))
    assert [r.error for r in rows] == [None, None]
    utc = dt.timezone.utc
    assert rows[0].passthrough["end"] == dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=utc)
    assert rows[0].passthrough["start"] == dt.datetime(1, 1, 1, tzinfo=utc)
    assert rows[1].passthrough["end"].utcoffset() == dt.timedelta(hours=1)  # as it was


def test_two_columns_of_one_name_are_refused(tmp_path):
    table = pa.Table.from_arrays(
        [pa.array(["r0"]), pa.array(["short"]), pa.array(["long prompt"])],
        names=["id", "prompt", "prompt"],
    )
    pq.write_table(table, tmp_path / "a.parquet")
    with pytest.raises(CorruptInputError, match="has 2 columns named 'prompt'"):
        read(tmp_path / "a.parquet")


def test_messages_as_spark_maps_or_json_text(tmp_path):
    """Spark's array<map<string,string>> (read as lists of key/value pairs) and messages kept
    as JSON text were refused on every row: the job exited 0 with nothing done."""
    table = pa.table(
        {
            "maps": pa.array(
                [[[("role", "user"), ("content", "Hi")]]],
                type=pa.list_(pa.map_(pa.string(), pa.string())),
            ),
            "text": ['[{"role": "user", "content": "Hi"}]'],
        }
    )
    pq.write_table(table, tmp_path / "chat.parquet")
    for column in ("maps", "text"):
        (row,) = read(tmp_path / "chat.parquet", messages_column=column)
        assert row.error is None and row.messages == [{"role": "user", "content": "Hi"}]


def test_a_file_without_the_named_id_column_has_rows_without_ids(tmp_path):
    """input.id_column: uid, and one file has doc_id instead (a renamed column): its rows got
    file:row ids without a word. They are rows without an id now, as a null uid is; only the
    default id column may be absent (file:row ids)."""
    pq.write_table(pa.table({"uid": ["u0"], "prompt": ["hi"]}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"doc_id": ["d1"], "prompt": ["ho"]}), tmp_path / "part-1.parquet")
    rows = read(tmp_path, id_column="uid")
    assert summary(rows) == [(0, "u0", True), (1, "part-1.parquet:0", False)]
    assert "missing id: column 'uid' is absent, null or empty" in rows[1].error
    rows = read(tmp_path / "part-1.parquet")  # the default, id: absent, file:row ids
    assert summary(rows) == [(0, "part-1.parquet:0", True)]


def test_a_binary_prompt_column_is_read_as_utf8_text(tmp_path):
    """Impala, old Hive and Spark write string columns as BINARY without the UTF8 mark:
    every row failed ("missing prompt ... got bytes"); they are text, as Spark's
    binaryAsString reads them. Bytes that are not UTF-8 are their row's error; a wrong type
    is a bad prompt, not a missing one."""
    prompts = pa.array(["héllo".encode(), b"\xff\xfe", b"ok"], pa.binary())
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": prompts}), tmp_path / "in.parquet")
    rows = read(tmp_path / "in.parquet")
    assert [(r.row_id, r.prompt) for r in rows] == [("a", "héllo"), ("b", None), ("c", "ok")]
    assert "bad prompt: column 'prompt' holds bytes that are not UTF-8 text" in rows[1].error
    pq.write_table(pa.table({"id": ["n"], "prompt": [3]}), tmp_path / "num.parquet")
    (row,) = read(tmp_path / "num.parquet")
    assert "bad prompt: column 'prompt' must be a non-empty string, got the number 3" in row.error


def test_a_binary_messages_column_of_json_text_is_read_as_a_prompt_column_is(tmp_path):
    """Messages kept as JSON text in a BINARY column (Impala, old Hive, Spark) were refused
    on every row ("got bytes") where a BINARY prompt column is read as UTF-8 text; they are
    read the same way now, bytes that are not UTF-8 their row's error."""
    cells = pa.array([b'[{"role": "user", "content": "H\xc3\xa9"}]', b"\xff["], pa.binary())
    pq.write_table(pa.table({"id": ["a", "b"], "chat": cells}), tmp_path / "in.parquet")
    good, bad = read(tmp_path / "in.parquet", messages_column="chat")
    assert good.error is None and good.messages == [{"role": "user", "content": "Hé"}]
    assert "bad messages: column 'chat' holds bytes that are not UTF-8 text" in bad.error


def test_an_empty_binary_prompt_is_missing_as_an_empty_string_is(tmp_path):
    prompts = pa.array([b"", None], pa.binary())
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": prompts}), tmp_path / "in.parquet")
    assert all("missing prompt" in r.error for r in read(tmp_path / "in.parquet"))


def test_wide_rows_are_decoded_a_few_at_a_time(tmp_path, monkeypatch):
    """1,024 rows of a 5 MB column were 5 GB of Python strings at once (an audit): a batch
    holds about PARQUET_BATCH_BYTES of the columns read, at least one row."""
    monkeypatch.setattr(parquet_records, "PARQUET_BATCH_BYTES", 1 << 20, raising=False)
    decoded: list[int] = []
    records = parquet_records._records

    def counting(batch: pa.RecordBatch, start: int) -> list:
        decoded.append(batch.num_rows)
        return records(batch, start)

    monkeypatch.setattr(parquet_records, "_records", counting)
    wide = [f"{i:06d}" * 50_000 for i in range(40)]  # 300 KB each, in one row group
    f = write_parquet(
        tmp_path / "in.parquet", {"prompt": [f"p{i}" for i in range(40)], "big": wide}, 40
    )
    rows = read(f, passthrough_columns=("big",))
    assert [r.passthrough["big"] for r in rows] == wide
    assert max(decoded) <= 4 and sum(decoded) == 40  # 1 MiB: 3 rows of 300 KB a batch
    decoded.clear()
    huge = ["y" * (3 << 20)]  # one row larger than a batch: still read
    f = write_parquet(tmp_path / "huge.parquet", {"prompt": ["p"], "big": huge})
    assert [r.passthrough["big"] for r in read(f, passthrough_columns=("big",))] == huge
    assert decoded == [1]
