"""Input reads from S3 through a fault-injecting proxy (tests/fault_proxy.py) in front of
moto: a store that fails (503 SlowDown, 500 InternalError, after the client's retries) is a
storage error naming the object, never "does not exist" or "truncated or corrupt", which
run-job reports as lasting (exit 2) where a rerun once the store is back gets past it."""

from __future__ import annotations

import gzip
import json
import random

import fsspec
import pytest

from tests.fault_proxy import FaultyS3, faulty_s3  # noqa: F401
from tests.s3_server import s3_endpoint  # noqa: F401
from tokenmill.io.readers.compression import CorruptInputError
from tokenmill.io.readers.file_listing import list_input_files
from tokenmill.io.readers.input_config import InputConfig
from tokenmill.io.readers.jsonl_records import JsonlRecords

BUCKET = "faulty-input"
# Random text (gzip cannot shrink it below s3fs's block): the reads go on past the first.
LINES = b"".join(
    json.dumps({"id": i, "prompt": random.Random(i).randbytes(40).hex()}).encode() + b"\n"
    for i in range(20_000)
)


def _put(s3: FaultyS3, name: str, data: bytes) -> str:
    fs = fsspec.filesystem("s3", **s3.direct)
    fs.mkdir(BUCKET)
    fs.pipe_file(f"{BUCKET}/{name}", data)
    return f"s3://{BUCKET}/{name}"


@pytest.mark.parametrize(("status", "code"), [(503, "SlowDown"), (500, "InternalError")])
def test_a_file_input_the_store_will_not_show_is_a_storage_error(
    faulty_s3: FaultyS3,  # noqa: F811
    status: int,
    code: str,
) -> None:
    """Its HEAD fails: fsspec's isfile answered False, and the input "does not exist"."""
    url = _put(faulty_s3, "in/a.jsonl", LINES[:1000])
    faulty_s3.proxy.fail(status, code, methods=("HEAD",))
    cfg = InputConfig(path=url, storage_options=faulty_s3.options(retries=0))
    with pytest.raises(OSError) as raised:
        list_input_files(cfg)
    assert not isinstance(raised.value, FileNotFoundError), raised.value
    assert faulty_s3.proxy.stats["failed"] > 0
    faulty_s3.proxy.clear()
    assert list_input_files(cfg) == [url]


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz"])
def test_a_read_that_fails_midway_names_the_file_and_keeps_its_type(
    faulty_s3: FaultyS3,  # noqa: F811
    name: str,
) -> None:
    """GETs fail once the first row is read (a block of the file): an OSError naming the file,
    not a CorruptInputError (gzip's read said "the file may be truncated or corrupt")."""
    url = _put(faulty_s3, name, gzip.compress(LINES) if name.endswith(".gz") else LINES)
    options = faulty_s3.options(retries=0) | {"default_block_size": 1 << 16}
    with JsonlRecords(url, options) as records:
        rows = iter(records)
        next(rows)
        faulty_s3.proxy.fail(503, "SlowDown", methods=("GET",))
        with pytest.raises(OSError) as raised:
            list(rows)
    assert not isinstance(raised.value, CorruptInputError)
    assert url in str(raised.value), raised.value


@pytest.mark.parametrize("outage", ["refuse", "hang"])
@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz"])
def test_a_store_out_of_reach_midway_is_a_storage_error_naming_the_file(
    faulty_s3: FaultyS3,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    outage: str,
) -> None:
    """The store goes out of reach once the first row is read: connections refused
    (botocore's EndpointConnectionError, no OSError) or every GET held past the read timeout
    (its ReadTimeoutError, an OSError built from keywords only, as its ConnectTimeoutError
    is). Each came out as botocore raised it, naming the endpoint but not the object (run-job:
    "storage error: ConnectTimeoutError: Connect timeout on endpoint URL: ..."); now an
    OSError naming the file, which run-job reports as a storage error (exit 75)."""
    url = _put(faulty_s3, name, gzip.compress(LINES) if name.endswith(".gz") else LINES)
    # A short timeout, and one try of s3fs's (it retries a timeout 5 times, backing off, for
    # each of its reads' own 5 retries: ~18 s of held GETs), which no storage option sets
    monkeypatch.setattr("s3fs.S3FileSystem.retries", 1)
    options = faulty_s3.options(timeout_s=0.2, retries=0) | {"default_block_size": 1 << 16}
    with JsonlRecords(url, options) as records:
        rows = iter(records)
        next(rows)
        if outage == "refuse":
            faulty_s3.proxy.pause()
        else:
            faulty_s3.proxy.hang(methods=("GET",))
        with pytest.raises(OSError) as raised:
            list(rows)
    assert not isinstance(raised.value, (CorruptInputError, FileNotFoundError)), raised.value
    assert url in str(raised.value), raised.value
    assert outage == "refuse" or faulty_s3.proxy.stats["hung"] > 0, faulty_s3.proxy.stats
