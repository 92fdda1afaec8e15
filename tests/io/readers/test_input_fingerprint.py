"""input_fingerprint: stable for the same input, changed by data, files or columns."""

from __future__ import annotations

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
