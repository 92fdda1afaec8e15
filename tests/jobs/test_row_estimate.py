"""The input's row total for progress: remote JSONL estimated from a sample of each file (on
moto's S3), never downloaded whole; local files and small remote ones counted exactly."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import fsspec
import pytest

from tests.s3_server import count_fetched, s3_endpoint  # noqa: F401
from tokenmill.io.readers import InputConfig, iter_input_rows
from tokenmill.jobs import row_estimate
from tokenmill.jobs.row_count import _format_by_name, input_row_total
from tokenmill.jobs.row_estimate import RowTotal


def _rows(n: int, seed: int = 0) -> bytes:
    """``n`` JSONL rows of one length each (random letters: they compress as text does)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    return b"".join(
        json.dumps({"id": f"{i:08d}", "prompt": "".join(rng.choices(letters, k=200))}).encode()
        + b"\n"
        for i in range(n)
    )


def _s3(s3_endpoint: tuple[str, dict[str, Any]]) -> tuple[Any, dict[str, Any]]:  # noqa: F811
    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("data")
    return fs, options


def test_remote_jsonl_is_estimated_from_its_first_mib_not_downloaded(
    s3_endpoint: tuple[str, dict[str, Any]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 2.9 MB file on S3: the total is an estimate within 2% of its 12,000 rows, from one
    read of SAMPLE_BYTES; reading its rows fetches the whole file (the instrument's check)."""
    fs, options = _s3(s3_endpoint)
    data = _rows(12_000)
    fs.pipe_file("data/rows.jsonl", data)
    cfg = InputConfig(path="s3://data/rows.jsonl", storage_options=options)
    fetched = count_fetched(monkeypatch)
    total = input_row_total(cfg)
    assert total is not None and total.estimated
    assert abs(total.rows - 12_000) / 12_000 < 0.02, total
    assert sum(fetched) <= row_estimate.SAMPLE_BYTES < len(data) / 2
    fetched.clear()
    assert sum(1 for _ in iter_input_rows(cfg)) == 12_000 and sum(fetched) >= len(data)


def test_compressed_remote_jsonl_is_estimated_from_compressed_bytes(
    s3_endpoint: tuple[str, dict[str, Any]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gzip on S3: rows per compressed byte of the sample's decompressed prefix, times the
    compressed size; bzip2 (900 KB blocks) is left unknown rather than far too low."""
    import bz2

    fs, options = _s3(s3_endpoint)
    monkeypatch.setattr(row_estimate, "SAMPLE_BYTES", 64 << 10)
    data = _rows(6_000)
    fs.pipe_file("data/rows.jsonl.gz", gzip.compress(data))
    fs.pipe_file("data/other/rows.jsonl.bz2", bz2.compress(data))
    fetched = count_fetched(monkeypatch)
    total = input_row_total(InputConfig(path="s3://data/rows.jsonl.gz", storage_options=options))
    assert total is not None and total.estimated
    assert abs(total.rows - 6_000) / 6_000 < 0.05, total
    assert sum(fetched) <= 64 << 10
    bzip2 = InputConfig(path="s3://data/other/rows.jsonl.bz2", storage_options=options)
    assert input_row_total(bzip2) is None


@pytest.mark.parametrize("codec", ["gzip", "zstd", "xz"])
def test_a_highly_compressed_sample_is_decompressed_only_so_far(
    s3_endpoint: tuple[str, dict[str, Any]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    codec: str,
) -> None:
    """One prompt repeated (a benchmark's input): a 1 MiB sample of it as zstd is GiBs of
    text, all held (and split into lines) by the count beside the run. The sample is
    decompressed up to DECOMPRESSED_BYTES, its rows counted per compressed byte used, and
    the estimate stays within 10% of the rows."""
    import lzma
    import tracemalloc

    import zstandard

    fs, options = _s3(s3_endpoint)
    # samples that decompress to 13..20 MiB (a file no larger is counted whole)
    sample = {"gzip": 64 << 10, "zstd": 2 << 10, "xz": 2 << 10}[codec]
    monkeypatch.setattr(row_estimate, "SAMPLE_BYTES", sample)
    monkeypatch.setattr(row_estimate, "DECOMPRESSED_BYTES", 6 << 20)
    row = b'{"prompt": "Summarize the following text in one sentence, please."}\n'
    rows = (24 << 20) // len(row)
    compress = {
        "gzip": gzip.compress,
        "zstd": zstandard.ZstdCompressor().compress,
        "xz": lzma.compress,
    }[codec]
    packed = compress(row * rows)
    suffix = {"gzip": "gz", "zstd": "zst", "xz": "xz"}[codec]
    fs.pipe_file(f"data/same.jsonl.{suffix}", packed + compress(row * rows))  # two members
    cfg = InputConfig(path=f"s3://data/same.jsonl.{suffix}", storage_options=options)
    peaks: list[int] = []
    sample_file = row_estimate._sample

    def measured(*args: Any) -> Any:  # (the sample's own memory, not s3fs's client's)
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        try:
            return sample_file(*args)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1] - start)

    monkeypatch.setattr(row_estimate, "_sample", measured)
    tracemalloc.start()
    try:
        total = input_row_total(cfg)
    finally:
        tracemalloc.stop()
    assert total is not None and total.estimated
    # (the first compressed bytes, a frame's header and its first row, weigh more)
    assert abs(total.rows - 2 * rows) / (2 * rows) < 0.1, (total, 2 * rows)
    # Whole texts held took 52 / 58 / 35 MiB here (gzip / zstd / xz); decompressed so far,
    # ~8-15, and xz's decoder adds its 8 MiB dictionary, which tracemalloc counts (liblzma
    # allocates through Python): a run beside the suite read 21.5 MiB for xz.
    bound = (28 if codec == "xz" else 20) << 20
    assert len(peaks) == 1 and peaks[0] < bound, peaks


def _members(codec: str, data: bytes, rows_each: int) -> bytes:
    """``data`` (JSONL) as one member or frame per ``rows_each`` rows, concatenated: what
    ``cat a.gz b.gz`` and pigz's independent blocks give, and pzstd's layout for zstd (a
    skippable frame naming the next frame's size before each frame)."""
    import lzma
    import struct

    import zstandard

    lines = data.splitlines(keepends=True)
    parts = [b"".join(lines[i : i + rows_each]) for i in range(0, len(lines), rows_each)]
    if codec == "gzip":
        return b"".join(gzip.compress(part) for part in parts)
    if codec == "xz":
        return b"".join(lzma.compress(part) for part in parts)
    frames = [zstandard.ZstdCompressor().compress(part) for part in parts]
    return b"".join(struct.pack("<III", 0x184D2A50, 4, len(f)) + f for f in frames)


@pytest.mark.parametrize("codec", ["gzip", "zstd", "xz"])
def test_a_sample_of_many_members_or_frames_is_decompressed_across_them(
    s3_endpoint: tuple[str, dict[str, Any]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    codec: str,
) -> None:
    """An audit: the sample was decompressed to its first member's end, so concatenated gzip
    was estimated from a few rows (and 256 bytes past them: too low) and pzstd's file, a
    skippable frame first, from none (no total). Read across members, it is within 5%."""
    fs, options = _s3(s3_endpoint)
    monkeypatch.setattr(row_estimate, "SAMPLE_BYTES", 64 << 10)
    suffix = {"gzip": "gz", "zstd": "zst", "xz": "xz"}[codec]
    fs.pipe_file(f"data/parts.jsonl.{suffix}", _members(codec, _rows(6_000), rows_each=3))
    cfg = InputConfig(path=f"s3://data/parts.jsonl.{suffix}", storage_options=options)
    assert sum(1 for _ in iter_input_rows(cfg)) == 6_000  # (the reader reads them all)
    fetched = count_fetched(monkeypatch)
    total = input_row_total(cfg)
    assert total is not None and total.estimated
    assert abs(total.rows - 6_000) / 6_000 < 0.05, total
    assert sum(fetched) <= 64 << 10


def test_many_remote_files_take_the_sampled_files_bytes_per_row(
    s3_endpoint: tuple[str, dict[str, Any]],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """80 files (sizes from one listing, 16 sampled): within 3% of their rows, reading far
    less than the input; files no larger than the sample are counted exactly."""
    fs, options = _s3(s3_endpoint)
    monkeypatch.setattr(row_estimate, "SAMPLE_BYTES", 8 << 10)
    for part in range(80):
        fs.pipe_file(f"data/in/part-{part:03d}.jsonl", _rows(100 + part, seed=part))
    fs.pipe_file("data/small/a.jsonl", _rows(7))
    truth = sum(100 + part for part in range(80))
    fetched = count_fetched(monkeypatch)
    total = input_row_total(InputConfig(path="s3://data/in/", storage_options=options))
    assert total is not None and total.estimated
    assert abs(total.rows - truth) / truth < 0.03, (total, truth)
    assert sum(fetched) <= row_estimate.SAMPLED_FILES * (8 << 10)
    small = InputConfig(path="s3://data/small/a.jsonl", storage_options=options)
    assert input_row_total(small) == RowTotal(7, estimated=False)


def test_local_jsonl_is_counted_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local read is cheap: its rows are counted, never estimated."""
    monkeypatch.setattr(row_estimate, "SAMPLE_BYTES", 1 << 10)
    path = tmp_path / "rows.jsonl"
    path.write_bytes(_rows(301) + b"\n\n")
    assert input_row_total(InputConfig(path=str(path))) == RowTotal(301, estimated=False)


def test_the_count_takes_the_format_from_the_name_as_detect_format_does() -> None:
    """One rule for both (format_detection.format_by_name): a presigned URL's query is no
    part of the name, and a compressed JSONL name is JSONL."""
    cfg = InputConfig(path="unused")
    presigned = "https://h/part-0.parquet?X-Amz-Signature=abc.jsonl"
    assert _format_by_name(cfg, [presigned]) == "parquet"
    assert _format_by_name(cfg, ["s3://b/rows.JSONL.gz"]) == "jsonl"
    assert _format_by_name(InputConfig(path="unused", format="parquet"), ["x.jsonl"]) == "parquet"
