"""Bad rows: each kind becomes an error row in place; the stream and good rows go on."""

from __future__ import annotations

import pytest

from tests.io.readers.reader_files import read, summary, write_jsonl

GOOD_BEFORE = {"id": "before", "prompt": "ok"}
GOOD_AFTER = {"id": "after", "prompt": "ok"}


@pytest.mark.parametrize(
    ("line", "row_id", "message"),
    [
        ("{not json", "in.jsonl:2", "not valid JSON"),
        ('["a", "list"]', "in.jsonl:2", "expected a JSON object per line, got a list"),
        ("42", "in.jsonl:2", "expected a JSON object per line"),
        ({"id": None, "prompt": "x"}, "in.jsonl:2", "missing id"),
        ({"id": "", "prompt": "x"}, "in.jsonl:2", "missing id"),
        ({"prompt": "x"}, "in.jsonl:2", "missing id"),
        ({"id": {"a": 1}, "prompt": "x"}, "in.jsonl:2", "must hold a string, an integer or a UUID"),
        ({"id": "r"}, "r", "missing prompt: no column 'prompt'"),
        ({"id": "r", "prompt": ""}, "r", "missing prompt"),
        ({"id": "r", "prompt": ["a"]}, "r", "must be a non-empty string, got a list"),
        ({"id": "before", "prompt": "again"}, "in.jsonl:2", "duplicate id 'before'"),
    ],
)
def test_bad_row_between_good_rows(tmp_path, line, row_id, message):
    f = write_jsonl(tmp_path / "in.jsonl", [GOOD_BEFORE, line, GOOD_AFTER])
    rows = read(f)
    assert summary(rows) == [(0, "before", True), (1, row_id, False), (2, "after", True)]
    assert rows[1].source == f"{f}:2" and not rows[1].error.startswith(str(f))  # said once
    assert message in rows[1].error
    assert rows[1].prompt is None and rows[1].messages is None


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list of {role, content} messages, got a string"),
        (["hello"], "column 'messages'[0] must be an object"),
        ([{"role": "robot", "content": "x"}], "[0].role is 'robot'"),
        ([{"role": "user", "content": "x"}, {"role": "user"}], "[1].content must be a string"),
        ([{"role": "user", "content": []}], "non-empty list of text parts, got an empty list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
            "[0].content[0] is not a text part (got type 'image_url'); only text parts",
        ),
        # a text part whose text is not a string was "not a text part (got type 'text')"
        (
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            "[0].content[0].text must be a string, got the number 5",
        ),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            "[0].content[0].text must be a string, got null",
        ),
        ([{"content": "x"}], "[0].role is null; expected one of"),  # was "is None"
        ([{"role": "user", "content": ["x"]}], "[0].content[0] is not a text part (got a string)"),
    ],
)
def test_bad_messages_name_the_problem(tmp_path, messages, message):
    f = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"id": "a", "messages": [{"role": "user", "content": "x"}]},
            {"id": "b", "messages": messages},
            {"id": "c", "messages": [{"role": "user", "content": "y"}]},
        ],
    )
    rows = read(f, messages_column="messages")
    assert summary(rows) == [(0, "a", True), (1, "b", False), (2, "c", True)]
    assert message in rows[1].error


def test_invalid_utf8_line(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"id": "a", "prompt": "x"}\n{"id": "\xff"}\n{"id": "c", "prompt": "y"}\n')
    rows = read(f)
    assert summary(rows) == [(0, "a", True), (1, "in.jsonl:2", False), (2, "c", True)]
    assert "not valid UTF-8" in rows[1].error


def test_duplicates_across_files_keep_the_first(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "prompt": "first"}, {"id": "y", "prompt": "1"}])
    write_jsonl(tmp_path / "b.jsonl", [{"id": "x", "prompt": "second"}, {"id": 5, "prompt": "2"}])
    write_jsonl(tmp_path / "c.jsonl", [{"id": "5", "prompt": "3"}])
    rows = read(tmp_path, passthrough_columns=("prompt",))
    # A duplicate's error row has its line's id: the duplicated id is the first row's alone.
    assert summary(rows) == [(0, "x", True), (1, "y", True), (2, "b.jsonl:1", False),
                             (3, "5", True), (4, "c.jsonl:1", False)]  # fmt: skip
    assert rows[0].prompt == "first"
    assert rows[2].source.endswith("b.jsonl:1") and "duplicate id 'x'" in rows[2].error
    assert rows[2].passthrough == {"prompt": "second"}


def test_a_bad_row_still_claims_its_id(tmp_path):
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": "x"}, {"id": "x", "prompt": "fixed?"}])
    rows = read(f)
    assert summary(rows) == [(0, "x", False), (1, "in.jsonl:2", False)]
    assert "missing prompt" in rows[0].error and "duplicate id" in rows[1].error


def test_openai_developer_role_and_text_parts_are_read_as_text(tmp_path):
    """OpenAI's ``developer`` role is a system message; content parts of type text are
    joined by newlines (as vLLM joins them); other keys are kept."""
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "ann"},
    ]  # fmt: skip
    f = write_jsonl(tmp_path / "chat.jsonl", [{"id": "a", "messages": messages}])
    (row,) = read(f, messages_column="messages")
    assert row.error is None
    assert row.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb", "name": "ann"},
    ]


def test_an_openai_tool_calling_turn_is_a_conversation_not_a_bad_row() -> None:
    """An assistant message calling tools has content null (OpenAI's shape), then a tool
    message answers it: both are rows' conversations, not errors."""
    from tokenmill.io.readers.messages import check_messages
    from tokenmill.io.readers.row_error import RowError

    calls = [{"id": "c1", "type": "function",
              "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]  # fmt: skip
    messages = check_messages(
        [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": None, "tool_calls": calls},
         {"role": "tool", "tool_call_id": "c1", "content": "18C"}],
        "body.messages", "r1",
    )  # fmt: skip
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"] == {
        "name": "weather",
        "arguments": {"city": "Paris"},
    }
    with pytest.raises(RowError, match=r"body.messages\[0\].content must be a string"):
        check_messages([{"role": "user", "content": None}], "body.messages", "r2")
    # OpenAI's refusing answer (content null, the text in refusal): a row error before
    refused = check_messages(
        [{"role": "user", "content": "Help?"},
         {"role": "assistant", "content": None, "refusal": "I can't help with that."},
         {"role": "user", "content": "Why?"}],
        "body.messages", "r3",
    )  # fmt: skip
    assert refused[1]["content"] == "I can't help with that."
    with pytest.raises(RowError, match=r"body.messages\[0\].content must be a string"):
        check_messages([{"role": "user", "content": None, "refusal": "x"}], "body.messages", "r4")


def test_a_parquet_tool_call_without_an_id_reads_as_the_jsonl_one(tmp_path) -> None:
    """A Parquet struct column holds every field of a tool call, null where the row has
    none: the call and its function reach the template without those fields, as from JSONL
    (a template testing ``tool_call.id is defined`` rendered ``id=None``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    calls_a = [{"type": "function", "function": {"name": "f", "arguments": '{"k": 1}'}}]
    calls_b = [{"id": "c1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    rows = [
        {"id": "a", "messages": [{"role": "user", "content": "x"},
                                 {"role": "assistant", "content": None, "tool_calls": calls_a}]},
        {"id": "b", "messages": [{"role": "user", "content": "y"},
                                 {"role": "assistant", "content": None, "tool_calls": calls_b}]},
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    from_parquet = read(tmp_path / "chat.parquet", messages_column="messages")
    from_jsonl = read(write_jsonl(tmp_path / "chat.jsonl", rows), messages_column="messages")
    assert [r.messages for r in from_parquet] == [r.messages for r in from_jsonl]
    assert from_parquet[0].messages[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"k": 1}}}
    ]


def test_an_error_row_never_takes_an_id_a_row_has(tmp_path):
    """A row without an id falls back to ``<file>:<line>``; where an earlier row gave itself
    that id, the error row took it too, and one id was in the output and in the errors."""
    f = write_jsonl(
        tmp_path / "f.jsonl",
        [
            {"prompt": "first", "id": "f.jsonl:2"},  # the next line's fallback id
            {"prompt": "second"},  # missing id
            "{not json",
            {"prompt": "fourth", "id": "f.jsonl:3#2"},
            {"prompt": "fifth", "id": "f.jsonl:2#2"},  # the error row of line 2 stands in as it
            {"prompt": "sixth", "id": "f.jsonl:3#2"},  # a row's own id, twice: a duplicate
        ],
    )
    rows = read(f)
    assert summary(rows) == [
        (0, "f.jsonl:2", True),
        (1, "f.jsonl:2#2", False),
        (2, "f.jsonl:3", False),
        (3, "f.jsonl:3#2", True),
        (4, "f.jsonl:2#2", True),
        (5, "f.jsonl:6", False),
    ]
    assert "duplicate id 'f.jsonl:3#2'" in rows[5].error


def test_a_bad_rows_stand_in_id_never_costs_a_later_row_its_own(tmp_path):
    """The second "dup" stood in as "in.jsonl:2", and the next row, whose own id that is
    (unique in the input), was refused as a duplicate "an earlier row already has": its
    output was lost."""
    f = write_jsonl(
        tmp_path / "in.jsonl",
        [{"id": "dup", "prompt": "1"}, {"id": "dup", "prompt": "2"},
         {"id": "in.jsonl:2", "prompt": "3"}],
    )  # fmt: skip
    rows = read(f)
    assert summary(rows) == [(0, "dup", True), (1, "in.jsonl:2", False), (2, "in.jsonl:2", True)]
    assert rows[1].source != rows[2].source  # the error row's source tells it apart


def test_a_row_without_its_messages_column_says_so():
    """It said "column 'messages' must be a non-empty list ..., got null" for a row with no
    such column (here "Messages"), without the columns the row has."""
    from tokenmill.io.readers import InputConfig
    from tokenmill.io.readers.plain_rows import PlainColumns, RowError, parse_plain_row

    cfg = InputConfig(path="x.jsonl", messages_column="messages", prompt_column=None)
    columns = PlainColumns.for_file(cfg, lambda name: True, "")
    row = {"id": "t6", "Messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(RowError) as e:
        parse_plain_row(row, columns=columns, row_index=0, source="x", fallback_id="x:1")
    assert "no column 'messages' in this row (it has: id, Messages)" in str(e.value)
    assert "input.messages_column" in str(e.value)


def test_an_openai_batch_line_read_as_a_plain_row_says_what_it_is(tmp_path):
    """Format detection looks at a file's first 20 lines: batch lines after 20 others read
    as plain rows, whose error named only the prompt column."""
    line = {"custom_id": "c1", "method": "POST", "url": "/v1/completions", "body": {}}
    for plain in ({"id": "p", "prompt": "x"}, {"prompt": "x"}):  # (missing id; prompt)
        lines = [{**plain, **({"id": f"p{i}"} if "id" in plain else {})} for i in range(20)]
        rows = read(write_jsonl(tmp_path / "in.jsonl", [*lines, line]))
        assert rows[0].error is None and "input.format: openai-batch" in rows[20].error


def test_a_row_failing_past_its_id_in_a_surprising_way_keeps_its_id(tmp_path):
    # A messages cell of JSON text nested past Python's recursion limit makes the parser
    # raise RecursionError, not RowError: the row is still an error row under its own id,
    # and claims it, as any other bad row does (a later row with it is a duplicate).
    deep = "[" * 100_000
    f = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"id": "a", "messages": deep},
            {"id": "a", "messages": [{"role": "user", "content": "x"}]},
        ],
    )
    rows = read(f, prompt_column=None, messages_column="messages")
    assert summary(rows) == [(0, "a", False), (1, "chat.jsonl:2", False)]
    assert "could not be read (RecursionError" in rows[0].error
    assert "duplicate id 'a'" in rows[1].error
