"""detect_format: by suffix, and OpenAI Batch by the first line."""

from __future__ import annotations

import pytest

from tests.io.readers.reader_files import batch_line, chat_body, write_jsonl, write_parquet
from tokenmill.io.readers import detect_format


def test_by_suffix(tmp_path):
    j = write_jsonl(tmp_path / "a.ndjson", [{"prompt": "x"}])
    p = write_parquet(tmp_path / "a.parquet", {"prompt": ["x"]})
    assert detect_format([str(j)], "auto") == "jsonl"
    assert detect_format([str(p)], "auto") == "parquet"


def test_openai_batch_by_first_non_blank_line(tmp_path):
    f = write_jsonl(tmp_path / "batch.jsonl", ["", batch_line("r1", chat_body())])
    assert detect_format([str(f)], "auto") == "openai-batch"


def test_a_bad_first_line_does_not_make_a_batch_file_plain(tmp_path):
    """The first line alone decided: one line without custom_id (or not JSON) made every good
    request line a bad plain row (or, with openai-batch output, failed the job)."""
    lines = ['{"method": "POST", "url": "/v1/chat/completions"}', "{not json"]
    lines += [batch_line(f"r{i}", chat_body()) for i in range(3)]
    f = write_jsonl(tmp_path / "batch.jsonl", lines)
    assert detect_format([str(f)], "auto") == "openai-batch"
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "x", "custom_id": 1}] * 30)
    assert detect_format([str(plain)], "auto") == "jsonl"


@pytest.mark.parametrize(
    "first",
    [
        '{"custom_id": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",  # RecursionError
        '{"custom_id": "a", "body": {"seed": ' + "1" * 5000 + "}}",  # int past 4300 digits
    ],
    ids=["nested", "long-integer"],
)
def test_an_unreadable_first_line_is_a_bad_row_not_a_failed_detection(tmp_path, first):
    """json.loads raises RecursionError or a plain ValueError (not JSONDecodeError) for such a
    line: detection crashed, as a storage error (exit 75) or an input.path error (exit 2),
    where the reader makes the line one bad row and runs the rest."""
    f = write_jsonl(tmp_path / "batch.jsonl", [first, batch_line("r1", chat_body())])
    assert detect_format([str(f)], "auto") == "openai-batch"


def test_explicit_format_wins(tmp_path):
    f = write_jsonl(tmp_path / "data.txt", [{"prompt": "x"}])
    assert detect_format([str(f)], "jsonl") == "jsonl"


def test_a_parquet_file_read_as_json_lines_is_refused(tmp_path):
    """An audit: `input.format: jsonl` on a Parquet file ran to exit 0 with every row bad
    ("line is not valid UTF-8"); the other way round was refused up front."""
    p = write_parquet(tmp_path / "rows.parquet", {"prompt": ["x"]})
    (tmp_path / "empty.jsonl").write_text("")
    for fmt in ("jsonl", "openai-batch"):
        said = f"is a Parquet file .* input.format {fmt} reads it as JSON"
        with pytest.raises(ValueError, match=said):
            detect_format([str(tmp_path / "empty.jsonl"), str(p)], fmt)
    named = tmp_path / "rows.jsonl"  # named as JSON Lines, Parquet inside
    named.write_bytes(p.read_bytes())
    with pytest.raises(ValueError, match="named as JSON Lines, .* Set input.format to parquet"):
        detect_format([str(named)], "auto")


@pytest.mark.parametrize(
    ("names", "message"),
    [(["a.jsonl", "b.parquet"], "mixes formats"), (["a.csv"], "set input.format")],
)
def test_unknown_or_mixed_suffixes_are_errors(tmp_path, names, message):
    files = [str(tmp_path / n) for n in names]
    with pytest.raises(ValueError, match=message):
        detect_format(files, "auto")


@pytest.mark.parametrize(
    "text",
    ['[\n  {"prompt": "x"}\n]\n', '[{"prompt": "x"}, {"prompt": "y"}]\n'],  # as json.dump
    ids=["pretty-printed", "one line"],
)
def test_json_array_file_is_explained(tmp_path, text):
    """A one-line array parsed (2M rows: 1.6 GB) and ended as one bad row, exit 0."""
    f = tmp_path / "a.json"
    f.write_text(text)
    with pytest.raises(ValueError, match="JSON array"):
        detect_format([str(f)], "auto")


def test_empty_part_files_before_the_first_line_say_nothing(tmp_path):
    """A Spark export's empty part-00000 made every OpenAI Batch row of the next file fail
    as a plain JSONL row missing its prompt."""
    empty = tmp_path / "part-00000.jsonl"
    empty.write_text("\n")
    batch = write_jsonl(tmp_path / "part-00001.jsonl", [batch_line("a", chat_body())])
    assert detect_format([str(empty), str(batch)], "auto") == "openai-batch"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_utf16_json_lines_are_refused_up_front(tmp_path, encoding):
    """An audit: a UTF-16 JSONL file (Windows PowerShell's default) ran to exit 0 with every
    line a bad row ("line is not valid UTF-8" / "not valid JSON", one more than it had rows)."""
    f = tmp_path / "rows.jsonl"
    f.write_bytes('{"prompt": "x"}\n{"prompt": "y"}\n'.encode(encoding))
    for fmt in ("auto", "jsonl", "openai-batch"):
        with pytest.raises(ValueError, match="is not UTF-8 text: .* UTF-16"):
            detect_format([str(f)], fmt)


def test_lines_ending_in_a_carriage_return_alone_are_refused_up_front(tmp_path):
    """An audit: a file of 6 rows joined by \\r (classic Mac OS, some spreadsheet exports)
    ran to exit 0 as one bad row ("extra data at column 46")."""
    f = tmp_path / "rows.jsonl"
    f.write_bytes(b"\r".join(b'{"id": "r%d", "prompt": "x"}' % i for i in range(6)) + b"\r")
    for fmt in ("auto", "jsonl", "openai-batch"):
        with pytest.raises(ValueError, match=r"rows.jsonl's lines end in a carriage return"):
            detect_format([str(f)], fmt)
    crlf = tmp_path / "crlf.jsonl"  # \r\n is a line end: fine
    crlf.write_bytes(b'{"prompt": "x"}\r\n{"prompt": "y"}\r\n')
    assert detect_format([str(crlf)], "auto") == "jsonl"


def test_the_first_lines_are_read_a_bounded_amount(tmp_path, monkeypatch):
    """A file with no newline was read whole to find its "first line"."""
    import tokenmill.io.readers.format_detection as detection

    monkeypatch.setattr(detection, "_LINE_CAP", 3 << 20)
    reads: list[int] = []
    real = detection.open_input

    def counting(url, options, **peek):
        f = real(url, options, **peek)
        read = f.read
        f.read = lambda n=-1: reads.append(n) or read(n)
        return f

    monkeypatch.setattr(detection, "open_input", counting)
    f = tmp_path / "one.jsonl"
    f.write_bytes(b'{"prompt": "' + b"x" * (20 << 20) + b'"}')
    assert detect_format([str(f)], "auto") == "jsonl"
    assert 0 < sum(reads) <= (3 << 20) + (1 << 20) and all(0 < n <= 1 << 20 for n in reads)
