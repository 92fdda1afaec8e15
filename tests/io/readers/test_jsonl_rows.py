"""Plain JSONL rows: contents, ids, order across files."""

from __future__ import annotations

from tests.io.readers.reader_files import read, summary, write_jsonl


def test_row_contents_and_passthrough(tmp_path):
    f = write_jsonl(
        tmp_path / "in.jsonl",
        [{"id": "q1", "prompt": "Hello", "lang": "en", "n": 3}, {"id": 7, "prompt": "Hi"}],
    )
    rows = read(f, passthrough_columns=("lang", "n"))
    assert rows[0].prompt == "Hello" and rows[0].messages is None
    assert rows[0].passthrough == {"lang": "en", "n": 3}
    assert rows[0].source == f"{f}:1"
    # Integer ids are stringified; a passthrough column a row lacks is None.
    assert (rows[1].row_id, rows[1].passthrough) == ("7", {"lang": None, "n": None})
    assert all(r.error is None and r.sampling == {} and r.custom_id is None for r in rows)


def test_files_stream_in_sorted_order_with_continuous_row_index(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"id": "b1", "prompt": "x"}])
    write_jsonl(
        tmp_path / "a.jsonl", [{"id": "a1", "prompt": "x"}, "", {"id": "a2", "prompt": "y"}]
    )
    write_jsonl(tmp_path / "c.jsonl", [{"id": "c1", "prompt": "x"}, {"id": "c2", "prompt": "x"}])
    rows = read(tmp_path)
    assert summary(rows) == [
        (0, "a1", True),
        (1, "a2", True),
        (2, "b1", True),
        (3, "c1", True),
        (4, "c2", True),
    ]
    # The blank line took no row_index but kept its line number.
    assert rows[1].source.endswith("a.jsonl:3")


def test_ids_from_file_and_line_when_there_is_no_id_column(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}, "", {"prompt": "y"}])
    assert [r.row_id for r in read(f)] == ["p.jsonl:1", "p.jsonl:3"]
    g = write_jsonl(tmp_path / "q.jsonl", [{"id": "a", "prompt": "x"}])
    assert [r.row_id for r in read(g, id_column=None)] == ["q.jsonl:1"]


def test_id_column_is_judged_per_file_from_its_first_object(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "a1", "prompt": "x"}])
    write_jsonl(tmp_path / "b.jsonl", ["oops", {"prompt": "y"}, {"id": "b3", "prompt": "z"}])
    rows = read(tmp_path)
    # b.jsonl's first object has no id: its rows get file:line ids, unless they carry one.
    assert summary(rows) == [(0, "a1", True), (1, "b.jsonl:1", False), (2, "b.jsonl:2", True),
                             (3, "b3", True)]  # fmt: skip


def test_messages_column(tmp_path):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ann"},
    ]
    f = write_jsonl(tmp_path / "chat.jsonl", [{"id": "c", "messages": conversation, "prompt": 1}])
    (row,) = read(f, messages_column="messages")
    assert row.error is None and row.prompt is None
    assert row.messages == conversation
