"""Reading JSONL input from S3 (moto on 127.0.0.1) through fsspec/s3fs."""

from __future__ import annotations

import json

import fsspec

from tests.s3_server import s3_endpoint  # noqa: F401 (the fixture)
from tokenmill.io.readers import (
    InputConfig,
    input_fingerprint,
    iter_input_rows,
    list_input_files,
)


def _put_jsonl(fs: fsspec.AbstractFileSystem, path: str, rows: list[dict]) -> None:
    fs.pipe(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def test_reads_two_jsonl_files_from_s3_prefix(s3_endpoint):  # noqa: F811
    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("inputs")
    _put_jsonl(fs, "inputs/prefix/b.jsonl", [{"id": "b1", "prompt": "three"}])
    _put_jsonl(
        fs,
        "inputs/prefix/a.jsonl",
        [{"id": "a1", "prompt": "one"}, {"id": "a2", "prompt": "two"}],
    )
    fs.pipe("inputs/prefix/_SUCCESS", b"")
    fs.pipe("inputs/other.jsonl", b'{"id": "x", "prompt": "not under the prefix"}\n')

    cfg = InputConfig(path="s3://inputs/prefix/", storage_options=options)
    assert list_input_files(cfg) == ["s3://inputs/prefix/a.jsonl", "s3://inputs/prefix/b.jsonl"]
    rows = list(iter_input_rows(cfg))
    assert [(r.row_index, r.row_id, r.prompt, r.error) for r in rows] == [
        (0, "a1", "one", None),
        (1, "a2", "two", None),
        (2, "b1", "three", None),
    ]
    assert rows[2].source == "s3://inputs/prefix/b.jsonl:1"

    globbed = InputConfig(path="s3://inputs/prefix/*.jsonl", storage_options=options)
    assert [r.row_id for r in iter_input_rows(globbed)] == ["a1", "a2", "b1"]
    assert input_fingerprint(globbed) == input_fingerprint(cfg)


def test_folder_markers_are_not_input_files(s3_endpoint):  # noqa: F811
    """An audit: the empty "folder/" keys the S3 console, rclone and S3A leave (and Hadoop's
    name_$folder$) were listed as files: a folder input with format auto failed ("cannot
    tell the format of s3://b/in/"), a Parquet one as a 0-byte Parquet file, and adding or
    removing an empty folder changed the input's fingerprint."""
    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("markers")
    _put_jsonl(fs, "markers/in/a.jsonl", [{"id": "a1", "prompt": "one"}])
    _put_jsonl(fs, "markers/in/sub/b.jsonl", [{"id": "b1", "prompt": "two"}])
    cfg = InputConfig(path="s3://markers/in", storage_options=options)
    before = input_fingerprint(cfg)
    for marker in (
        "markers/in/",
        "markers/in/sub/",
        "markers/in/empty/",
        "markers/in/old_$folder$",
    ):
        fs.pipe(marker, b"")
    want = ["s3://markers/in/a.jsonl", "s3://markers/in/sub/b.jsonl"]
    assert list_input_files(cfg) == want
    assert [r.row_id for r in iter_input_rows(cfg)] == ["a1", "b1"]
    assert input_fingerprint(cfg) == before
    globbed = InputConfig(path="s3://markers/in/**", storage_options=options)
    assert list_input_files(globbed) == want
