"""Compressed JSONL and OpenAI Batch inputs: gzip, zstd, bzip2, xz, by suffix or magic number."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
import zstandard
from fsspec.compression import compr

from tests.io.readers.reader_files import batch_line, chat_body, read, summary, write_parquet
from tests.s3_server import s3_endpoint  # noqa: F401 (the fixture)
from tokenmill.io.readers import InputConfig, detect_format, list_input_files
from tokenmill.io.readers.compression import open_input
from tokenmill.jobs.row_count import RowTotal, input_row_total

COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    ".gz": gzip.compress,
    ".zst": zstandard.ZstdCompressor().compress,
    ".bz2": bz2.compress,
    ".xz": lzma.compress,
}
SUFFIXES = list(COMPRESSORS)


def jsonl_bytes(rows: list[Any]) -> bytes:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    return "".join(line + "\n" for line in lines).encode()


def write_compressed(path: Path, rows: list[Any], suffix: str | None = None) -> Path:
    """``rows`` as JSONL compressed with the codec of ``suffix`` (default: the path's own)."""
    path.write_bytes(COMPRESSORS[suffix or path.suffix](jsonl_bytes(rows)))
    return path


ROWS = [{"id": "a", "prompt": "é 😀"}, "", {"id": "b", "prompt": "y"}]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_each_compression_is_read_by_suffix(tmp_path, suffix):
    f = write_compressed(tmp_path / f"in.jsonl{suffix}", ROWS)
    rows = read(f)
    assert summary(rows) == [(0, "a", True), (1, "b", True)]
    assert rows[0].prompt == "é 😀"
    # Line numbers are those of the decompressed text (the blank line 2 is kept).
    assert [r.source for r in rows] == [f"{f}:1", f"{f}:3"]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_id_column_is_found_after_leading_bad_lines(tmp_path, suffix):
    # Peeking for the first object's keys reads ahead; the rows still start at line 1.
    f = write_compressed(tmp_path / f"in.ndjson{suffix}", ["oops", {"id": "x", "prompt": "p"}])
    rows = read(f)
    assert summary(rows) == [(0, "in.ndjson" + suffix + ":1", False), (1, "x", True)]


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_concatenated_streams_are_read_to_the_end(tmp_path, suffix):
    compress = COMPRESSORS[suffix]
    first = jsonl_bytes([{"id": f"a{i}", "prompt": "x" * 100} for i in range(2000)])
    second = jsonl_bytes([{"id": "last", "prompt": "z"}])
    f = tmp_path / f"in.jsonl{suffix}"
    f.write_bytes(compress(first) + compress(second))
    rows = read(f)
    assert len(rows) == 2001 and rows[-1].row_id == "last"


def test_compressed_files_on_s3(s3_endpoint):  # noqa: F811
    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("zipped")
    fs.pipe("zipped/in/a.jsonl.gz", gzip.compress(jsonl_bytes(ROWS)))
    fs.pipe("zipped/in/b.jsonl.zst", COMPRESSORS[".zst"](jsonl_bytes([{"id": "c", "prompt": "z"}])))
    cfg = InputConfig(path="s3://zipped/in/", storage_options=options)
    rows = read(cfg.path, storage_options=options)
    assert summary(rows) == [(0, "a", True), (1, "b", True), (2, "c", True)]
    assert rows[2].source == "s3://zipped/in/b.jsonl.zst:1"
    assert input_row_total(cfg) == RowTotal(3, estimated=False)  # (small: counted)


def test_directory_picks_up_compressed_jsonl(tmp_path):
    for name in ["a.jsonl", "b.jsonl.gz", "c.ndjson.zst", "d.json.bz2", "e.JSONL.XZ"]:
        path = tmp_path / name
        data = jsonl_bytes([{"id": name, "prompt": "x"}])
        compress = COMPRESSORS.get(path.suffix.lower())
        path.write_bytes(compress(data) if compress else data)
    for name in ["_SUCCESS", ".hidden.jsonl.gz"]:
        (tmp_path / name).write_bytes(b"")
    found = list_input_files(InputConfig(path=str(tmp_path)))
    assert [Path(p).name for p in found] == [
        "a.jsonl",
        "b.jsonl.gz",
        "c.ndjson.zst",
        "d.json.bz2",
        "e.JSONL.XZ",
    ]
    assert [r.row_id for r in read(tmp_path)] == [Path(p).name for p in found]


def test_openai_batch_is_detected_inside_a_gzip_file(tmp_path):
    f = write_compressed(
        tmp_path / "batch.jsonl.gz", ["", batch_line("r1", chat_body()), batch_line("r2", {})]
    )
    assert detect_format([str(f)], "auto") == "openai-batch"
    rows = read(f)
    assert [(r.custom_id, r.error is None) for r in rows] == [("r1", True), ("r2", False)]


@pytest.mark.parametrize("name", ["in.jsonl.gz", "data.gz"])
def test_format_jsonl_with_a_gzip_file(tmp_path, name):
    f = write_compressed(tmp_path / name, ROWS, ".gz")
    assert summary(read(f, format="jsonl")) == [(0, "a", True), (1, "b", True)]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_compressed_bytes_without_a_compression_suffix_are_decompressed_by_magic(tmp_path, suffix):
    f = write_compressed(tmp_path / "in.jsonl", ROWS, suffix)
    assert summary(read(f)) == [(0, "a", True), (1, "b", True)]
    assert input_row_total(InputConfig(path=str(f))) == RowTotal(2, estimated=False)


def test_text_that_starts_like_a_bzip2_magic_stays_text(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b"BZh91AY and more\n" + jsonl_bytes([{"id": "b", "prompt": "y"}]))
    rows = read(f)
    assert summary(rows) == [(0, "in.jsonl:1", False), (1, "b", True)]
    assert "not valid JSON" in rows[0].error


def test_suffix_the_bytes_do_not_match_is_refused_naming_the_file(tmp_path):
    plain = tmp_path / "in.jsonl.gz"
    plain.write_bytes(jsonl_bytes(ROWS))
    with pytest.raises(ValueError, match="the name says gzip but the file is not gzip data") as e:
        read(plain)
    assert str(plain) in str(e.value)
    other = write_compressed(tmp_path / "in.jsonl.xz", ROWS, ".zst")
    with pytest.raises(ValueError, match="the name says xz but the file is zstd data"):
        read(other)


def test_truncated_gzip_is_a_value_error_naming_the_file(tmp_path):
    f = tmp_path / "in.jsonl.gz"
    data = gzip.compress(jsonl_bytes([{"id": f"r{i}", "prompt": "x"} for i in range(1000)]))
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="gzip decompression failed .* truncated or corrupt") as e:
        read(f)
    assert str(f) in str(e.value)


def test_a_zstd_file_of_several_frames_is_read_whole_and_a_cut_one_refused(tmp_path):
    """zstandard's stream reader ended quietly where a file was cut inside a frame: the rows
    before the cut came out as a whole, shorter input (rows lost, the job "complete")."""
    rows = [{"id": f"r{i}", "prompt": "x" * (i % 50)} for i in range(3000)]
    compress = zstandard.ZstdCompressor().compress
    data = compress(jsonl_bytes(rows[:1000])) + compress(jsonl_bytes(rows[1000:]))
    whole = tmp_path / "in.jsonl.zst"
    whole.write_bytes(data)
    assert [r.row_id for r in read(whole)] == [r["id"] for r in rows]
    for keep in (0.5, 0.9, 0.999):
        cut = tmp_path / f"cut{keep}.jsonl.zst"
        cut.write_bytes(data[: int(len(data) * keep)])
        with pytest.raises(ValueError, match="zstd decompression failed .* inside a zstd frame"):
            read(cut)


def pzstd_bytes(data: bytes, frame_bytes: int) -> bytes:
    """``data`` as pzstd (zstd's parallel CLI) writes it: each frame after a skippable frame
    (magic 0x184D2A50, 4 bytes of payload: the frame's compressed size)."""
    out = b""
    for at in range(0, len(data), frame_bytes):
        frame = zstandard.ZstdCompressor().compress(data[at : at + frame_bytes])
        out += struct.pack("<III", 0x184D2A50, 4, len(frame)) + frame
    return out


@pytest.mark.parametrize("name", ["in.jsonl.zst", "in.jsonl"])
def test_a_pzstd_file_starting_with_a_skippable_frame_is_read_whole(tmp_path, name):
    """pzstd's files start with a skippable frame (zstd -d reads them): the magic check took
    the name's zstd for a lie and refused the file ("the name says zstd but the file is not
    zstd data"); without the suffix its bytes were read as text, every line a bad row."""
    rows = [{"id": f"r{i}", "prompt": "x" * (1 + i % 7)} for i in range(300)]
    f = tmp_path / name
    f.write_bytes(pzstd_bytes(jsonl_bytes(rows), 1000))
    assert [(r.row_id, r.error) for r in read(f)] == [(r["id"], None) for r in rows]


def test_missing_codec_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.delitem(compr, "zstd")
    f = write_compressed(tmp_path / "in.jsonl.zst", ROWS)
    with pytest.raises(ValueError, match="zstd-compressed .* pip install zstandard") as e:
        read(f)
    assert str(f) in str(e.value)


def test_empty_compressed_file_has_no_rows(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(b"")
    write_compressed(tmp_path / "b.jsonl.zst", [{"id": "b", "prompt": "y"}])
    assert summary(read(tmp_path)) == [(0, "b", True)]


@pytest.mark.parametrize("fmt", ["auto", "parquet"])
def test_compressed_parquet_is_refused_naming_the_file(tmp_path, fmt):
    plain = write_parquet(tmp_path / "p.parquet", {"id": ["a"], "prompt": ["x"]})
    f = tmp_path / "p.parquet.gz"
    f.write_bytes(gzip.compress(plain.read_bytes()))
    plain.unlink()
    for path in (f, tmp_path):  # the file itself, and a directory holding it
        with pytest.raises(ValueError, match="Parquet compresses inside the file") as e:
            read(path, format=fmt)
        assert str(f) in str(e.value) and "gunzip p.parquet.gz" in str(e.value)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_row_count_counts_decompressed_lines(tmp_path, suffix):
    f = write_compressed(tmp_path / f"in.jsonl{suffix}", ROWS + ["", {"id": "c", "prompt": "z"}])
    assert input_row_total(InputConfig(path=str(f))) == RowTotal(3, estimated=False)


def test_open_input_closes_the_file_under_the_codec(tmp_path):
    f = write_compressed(tmp_path / "in.jsonl.gz", ROWS)
    with open_input(str(f), {}) as stream:
        assert stream.readline() == jsonl_bytes(ROWS[:1])
        assert not stream.seekable()
        under = stream.raw._raw  # the fsspec file the gzip codec reads
    assert under.closed
