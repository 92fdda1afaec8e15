"""input_fingerprint: stable for the same input, changed by data, files or columns."""

from __future__ import annotations

import pytest

from tests.io.readers.reader_files import write_jsonl
from tokenmill.io.readers import InputConfig, input_fingerprint
from tokenmill.io.readers.input_fingerprint import EDGE_BYTES


def _fp(path, **kwargs):
    return input_fingerprint(InputConfig(path=str(path), **kwargs))


def test_stable_when_nothing_changes(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "a", "prompt": "x"}])
    write_jsonl(tmp_path / "b.jsonl", [{"id": "b", "prompt": "y"}])
    assert _fp(tmp_path) == _fp(tmp_path)
    # Storage options (credentials) are not part of it.
    assert _fp(tmp_path) == _fp(tmp_path, storage_options={"auto_mkdir": False})


def test_changes_with_content_files_and_columns(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": "a", "prompt": "x"}])
    before = _fp(tmp_path)
    a.write_text(a.read_text().replace('"x"', '"z"'))  # same size, different bytes
    edited = _fp(tmp_path)
    write_jsonl(tmp_path / "b.jsonl", [{"id": "b", "prompt": "y"}])
    added = _fp(tmp_path)
    assert len({before, edited, added}) == 3
    assert _fp(tmp_path, prompt_column="text") != added
    assert _fp(tmp_path, passthrough_columns=("id",)) != added


def test_sees_the_last_mib_of_a_large_file(tmp_path):
    big = tmp_path / "big.jsonl"
    line = b'{"prompt": "' + b"x" * 100 + b'"}\n'
    body = line * (3 * EDGE_BYTES // len(line))
    big.write_bytes(body)
    before = _fp(big)
    big.write_bytes(body[:-4] + b'y"}\n')
    assert len(big.read_bytes()) == len(body)
    assert _fp(big) != before


def test_many_files_read_at_once_give_what_one_at_a_time_gave(tmp_path, monkeypatch):
    """The fingerprint and the row count read their files 16 at a time (5,000 files on S3
    kept a job from its first row for a minute); the fingerprint is the one a file-by-file
    read gives, so outputs of earlier versions resume, and so is the count."""
    from tokenmill.io.readers import file_reads
    from tokenmill.jobs.row_count import RowTotal, input_row_total

    for i in range(40):
        rows = [{"id": f"r{i}-{j}", "prompt": "x" * (i * 7 + j)} for j in range(i % 5 + 1)]
        write_jsonl(tmp_path / f"part-{i:02d}.jsonl", rows)
    cfg = InputConfig(path=str(tmp_path))
    together = (input_fingerprint(cfg), input_row_total(cfg))
    monkeypatch.setattr(file_reads, "READERS", 1)
    assert (input_fingerprint(cfg), input_row_total(cfg)) == together
    assert together[1] == RowTotal(sum(i % 5 + 1 for i in range(40)), estimated=False)


def test_files_are_read_side_by_side() -> None:
    import time

    from tokenmill.io.readers.file_reads import map_files

    start = time.perf_counter()
    got = map_files(lambda name: time.sleep(0.05) or name.upper(), [f"f{i}" for i in range(32)])
    assert got == [f"F{i}" for i in range(32)]  # in order
    assert time.perf_counter() - start < 32 * 0.05 / 4  # 16 at a time: ~0.1 s, not 1.6 s


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_first_line_of_a_byte_order_mark_alone_is_in_the_fingerprint(
    tmp_path, monkeypatch, suffix
):
    """Before 9800fb8 that line was an error row (row 0), since then no row: a job begun
    before would resume over rows numbered one lower (one lost, one twice). Its fingerprint
    differs from the one it had then; every other file's is the one it had."""
    import gzip
    import importlib

    fingerprint_module = importlib.import_module("tokenmill.io.readers.input_fingerprint")

    body = b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n'
    marked, plain = tmp_path / f"m{suffix}", tmp_path / f"p{suffix}"
    for path, data in ((marked, b"\xef\xbb\xbf\n" + body), (plain, b"\xef\xbb\xbf" + body)):
        path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    now = {p: input_fingerprint(InputConfig(path=str(p))) for p in (marked, plain)}
    monkeypatch.setattr(fingerprint_module, "_mark_alone_first", lambda url, head, options: False)
    before = {p: input_fingerprint(InputConfig(path=str(p))) for p in (marked, plain)}
    assert now[marked] != before[marked]
    assert now[plain] == before[plain]
