"""Bad JSON lines: a message that reads well for each JSONDecodeError, with an editor's column."""

from __future__ import annotations

import pytest

from tests.io.readers.reader_files import read

GOOD = b'{"id": "ok", "prompt": "x"}\n'
UNTERMINATED = """unterminated string starting at column 8, near '{"id": "abc'"""
NO_NAME = "expecting property name enclosed in double quotes at column"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'{"id": "abc', UNTERMINATED),
        # The line break is not part of the string: still "unterminated", not "control char".
        (b'{"id": "abc\r\n', UNTERMINATED),
        (b'{"id": "abc\n', UNTERMINATED),
        (b"{id: 1}\r\n", f"{NO_NAME} 2, near '{{id: 1}}'"),
        # Leading spaces count; multi-byte characters count once each.
        (b'    {"id" 1}', """expecting ':' delimiter at column 11, near '    {"id" 1}'"""),
        ('{"é": "ü", x}'.encode(), f"""{NO_NAME} 12, near '"é": "ü", x}}'"""),
        ('{"k": "😀😀", oops}'.encode(), f"""{NO_NAME} 13, near 'k": "😀😀", oops}}'"""),
        (b'{"id": 1} x', """extra data at column 11, near '{"id": 1} x'"""),
        (b"[1,]", "expecting value at column 4, near '[1,]'"),
        (b'{"id": "a\tb"}', """invalid control character at column 10, near '{"id": "a\\tb"}'"""),
        (
            b'{"prompt": "' + b"x" * 50 + b'" "y"}',
            """expecting ',' delimiter at column 65, near 'xxxxxxxx" "y"}'""",
        ),
    ],
)
def test_message_says_what_and_the_column_an_editor_shows(tmp_path, line, message):
    f = tmp_path / "in.jsonl"
    f.write_bytes(GOOD + line + b"\n" + GOOD.replace(b"ok", b"ok2"))
    rows = read(f)
    assert [r.error is None for r in rows] == [True, False, True]
    error = rows[1].error
    assert error.endswith(f"line is not valid JSON: {message}"), error
    assert "at at" not in error
    # The location is the caller's to add, once: the reader's message never carries it.
    assert error.count(f"{f}:2") <= 1


def test_byte_order_mark_on_line_one_takes_no_column(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"id" 1}\r\n' + GOOD)
    error = read(f)[0].error
    assert error.endswith(
        """not valid JSON: expecting ':' delimiter at column 7, near '{"id" 1}'"""
    )


def test_byte_order_mark_starting_a_later_line_is_dropped(tmp_path):
    """``cat a.jsonl b.jsonl`` where b.jsonl starts with a mark: b's first row was refused
    ("expecting value at column 1, near '\\ufeff{...'"); a mark alone stays a bad row that
    says what it is (a blank line would renumber the rows after it)."""
    f = tmp_path / "in.jsonl"
    mark = b"\xef\xbb\xbf"
    f.write_bytes(
        GOOD + mark + b'{"id": "b", "prompt": "y"}\r\n' + mark + b"\n" + mark + b'{"id" 1}'
    )
    rows = read(f)
    assert [(r.row_id, r.prompt, r.source) for r in rows[:2]] == [
        ("ok", "x", f"{f}:1"),
        ("b", "y", f"{f}:2"),
    ]
    assert rows[1].error is None
    assert (rows[2].source, rows[2].error) == (
        f"{f}:3",
        "line holds only a byte-order mark (U+FEFF), as where files were joined with cat; "
        "delete the line",
    )
    assert rows[3].error.endswith("""expecting ':' delimiter at column 7, near '{"id" 1}'""")


def test_excerpt_is_at_most_twenty_characters_and_escaped(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"prompt": "' + b"y" * 200 + b'\x01 and the line goes on"}\n')
    error = read(f)[0].error
    assert "invalid control character at column 213" in error
    assert error.endswith(", near " + repr("y" * 10 + "\x01 and the ")), error


@pytest.mark.parametrize("line_one", [b"\xef\xbb\xbf\n", b"\xef\xbb\xbf  \r\n"])
def test_a_byte_order_mark_alone_on_line_one_is_a_blank_line(tmp_path, line_one):
    """It was a bad row ("expecting value at column 1"), where blank lines are no rows; the
    row count (progress) and the format detection read it as blank too."""
    from tokenmill.io.readers import InputConfig, detect_format
    from tokenmill.jobs.row_count import RowTotal, input_row_total

    f = tmp_path / "in.jsonl"
    f.write_bytes(line_one + GOOD + b"\xef\xbb\xbf\n")  # (a mark on another line is no mark)
    rows = read(f)
    assert [(r.row_id, r.error is None) for r in rows] == [("ok", True), ("in.jsonl:3", False)]
    assert input_row_total(InputConfig(path=str(f))) == RowTotal(2, estimated=False)
    batch = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
    f.write_bytes(line_one + batch)
    assert detect_format([str(f)], "auto", {}) == "openai-batch"
