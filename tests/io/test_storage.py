"""OutputStore: names stay below the prefix, writes are all-or-nothing, local and on S3."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest

from tests.fault_proxy import FaultyS3, faulty_s3  # noqa: F401
from tokenmill.io import storage
from tokenmill.io.storage import OutputStore, is_temp_name

try:  # the shared moto fixture, once it exists; until then the local one below
    from tests.s3_server import s3_endpoint  # noqa: F401
except ImportError:

    @pytest.fixture(scope="session")
    def s3_endpoint() -> Iterator[tuple[str, dict[str, Any]]]:
        pytest.importorskip("s3fs")
        moto_server = pytest.importorskip("moto.server")
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        options = {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": endpoint,
        }
        try:
            yield endpoint, options
        finally:
            server.stop()


def test_path_joins_below_the_root(tmp_path) -> None:
    store = OutputStore(str(tmp_path / "out") + "/")
    assert store.is_local
    assert store.url == str(tmp_path / "out")
    assert store.path("shards/part-00000.parquet") == str(
        tmp_path / "out/shards/part-00000.parquet"
    )


@pytest.mark.parametrize(
    "name", ["../x", "/etc/x", "a/../../b", "", "a//b", "./a", "a/..", "C:/x", "a\\..\\b"]
)
def test_names_outside_the_prefix_are_rejected(tmp_path, name: str) -> None:
    store = OutputStore(str(tmp_path))
    for call in (store.path, store.read_bytes, store.exists, store.delete):
        with pytest.raises(ValueError, match="output"):
            call(name)
    with pytest.raises(ValueError, match="output"):
        store.write_atomic(name, b"x")
    assert os.listdir(tmp_path) == []


def test_write_read_list_delete(tmp_path) -> None:
    store = OutputStore(str(tmp_path / "out"))
    assert store.read_bytes("a.json") is None and not store.exists("a.json")
    assert store.list() == []
    store.write_atomic("shards/part-00001.jsonl", b"1")
    store.write_atomic("shards/part-00000.jsonl", b"0")
    store.write_atomic("a.json", b"{}")
    store.write_atomic("a.json", b'{"v": 2}')  # replaces
    assert store.read_bytes("a.json") == b'{"v": 2}'
    assert store.exists("shards/part-00000.jsonl") and not store.exists("shards")
    assert store.list() == ["a.json", "shards/part-00000.jsonl", "shards/part-00001.jsonl"]
    assert store.list("shards/") == ["shards/part-00000.jsonl", "shards/part-00001.jsonl"]
    assert store.list("shards/part-00001") == ["shards/part-00001.jsonl"]
    assert store.list("errors/") == []
    store.delete("a.json")
    store.delete("a.json")  # missing is fine
    assert store.list() == ["shards/part-00000.jsonl", "shards/part-00001.jsonl"]


def test_crash_before_rename_leaves_no_partial_file(tmp_path, monkeypatch) -> None:
    store = OutputStore(str(tmp_path))
    store.write_atomic("m.json", b"old")

    def crash(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(storage.os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        store.write_atomic("m.json", b"new")
    with pytest.raises(OSError, match="disk gone"):
        store.write_atomic("shards/part-00000.jsonl", b"data")
    monkeypatch.undo()
    # the old content survives, the new name never appears, the failed writer cleaned up
    assert store.read_bytes("m.json") == b"old"
    assert not store.exists("shards/part-00000.jsonl")
    assert sorted(os.listdir(tmp_path)) == ["m.json", "shards"]
    assert os.listdir(tmp_path / "shards") == []


def test_a_full_disk_names_the_file_it_was_writing(tmp_path, monkeypatch) -> None:
    """A write or fsync that fails (ENOSPC, EFBIG, EIO) raises an OSError naming no file;
    run-job printed "storage error: OSError: [Errno 28] No space left on device" without
    saying which output or disk was full (an audit). The error keeps its type and errno."""
    import errno

    store = OutputStore(str(tmp_path))

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.os, "fsync", full)
    with pytest.raises(OSError, match=r"No space left on device: .*part-00003\.parquet") as info:
        store.write_atomic("shards/part-00003.parquet", b"data")
    assert type(info.value) is OSError and info.value.errno == errno.ENOSPC
    assert info.value.filename == str(tmp_path / "shards" / "part-00003.parquet")
    monkeypatch.undo()
    assert os.listdir(tmp_path / "shards") == []  # the temporary file went too


def _written_in_a_block_or_not(store: OutputStore) -> None:
    """``writing`` commits what the block wrote once it ends, and nothing when it raises (a
    shard's row that cannot be encoded, part of the shard written)."""
    store.write_atomic("shards/part-00000.jsonl", b"old\n")
    with pytest.raises(ValueError, match="row 3"), store.writing("shards/part-00000.jsonl") as f:
        f.write(b"new, in part")
        raise ValueError("row 3 cannot be written")
    assert store.read_bytes("shards/part-00000.jsonl") == b"old\n"
    with pytest.raises(ValueError, match="row 3"), store.writing("shards/part-00001.jsonl") as f:
        f.write(b"new, in part")
        raise ValueError("row 3 cannot be written")
    assert store.list() == ["shards/part-00000.jsonl"]  # no partial file or object
    with store.writing("shards/part-00000.jsonl") as f:
        f.write(b"new\n")
        f.write(b"lines\n")
    assert store.read_bytes("shards/part-00000.jsonl") == b"new\nlines\n"


def test_a_removed_output_folder_is_not_made_again_by_a_write(tmp_path) -> None:
    """An audit: ``rm -rf out/`` under a running job, and its next shard's write made the
    folder again holding that shard alone, which the next run refused as another's files.
    A root never seen yet is made (a new output), and subfolders below a root that is there."""
    store = OutputStore(str(tmp_path / "new" / "out"))
    store.write_atomic("shards/a.jsonl", b"1")  # a new output: its folders are made
    shutil.rmtree(tmp_path / "new")
    with pytest.raises(FileNotFoundError, match="output folder was removed"):
        store.write_atomic("shards/b.jsonl", b"2")
    with pytest.raises(FileNotFoundError), store.writing("shards/c.jsonl") as f:
        f.write(b"3")
    assert not (tmp_path / "new").exists()
    (tmp_path / "new" / "out").mkdir(parents=True)  # put back: written as before
    store.write_atomic("errors/d.jsonl", b"4")
    assert store.read_bytes("errors/d.jsonl") == b"4"


def test_writing_commits_all_or_nothing(tmp_path) -> None:
    _written_in_a_block_or_not(OutputStore(str(tmp_path), owner="t"))
    assert os.listdir(tmp_path / "shards") == ["part-00000.jsonl"]  # no temporary file left


def test_killed_writer_leaves_temp_that_cleanup_removes(tmp_path, monkeypatch) -> None:
    store = OutputStore(str(tmp_path))

    def killed(src: str, dst: str) -> None:
        raise KeyboardInterrupt  # stands for SIGKILL: the process ends here

    # a killed process runs no cleanup either
    monkeypatch.setattr(storage.os, "replace", killed)
    monkeypatch.setattr(storage, "_remove_quietly", lambda path: None)
    with pytest.raises(KeyboardInterrupt):
        store.write_atomic("shards/part-00000.parquet", b"partial?")
    with pytest.raises(KeyboardInterrupt):  # a commit's manifest record (manifest.py)
        store.write_atomic("job.manifest.d/00000000.json", b"{")
    monkeypatch.undo()

    assert is_temp_name(os.listdir(tmp_path / "job.manifest.d")[0])
    left = os.listdir(tmp_path / "shards")
    assert len(left) == 1 and is_temp_name(left[0]) and left[0].startswith(".part-00000.parquet")
    assert not store.exists("shards/part-00000.parquet")
    assert store.list() == []  # temp files are never listed as output
    store.write_atomic("keep.json", b"{}")
    assert store.cleanup_temp() == 2
    assert store.cleanup_temp() == 0
    assert os.listdir(tmp_path / "shards") == os.listdir(tmp_path / "job.manifest.d") == []
    assert store.list() == ["keep.json"]


def test_temp_like_names_are_refused(tmp_path) -> None:
    store = OutputStore(str(tmp_path))
    with pytest.raises(ValueError, match="temporary"):
        store.write_atomic(".x.tmp-0123456789abcdef", b"")


def test_empty_url_is_refused() -> None:
    with pytest.raises(ValueError, match="output.path"):
        OutputStore("  ")


def test_s3_round_trip(s3_endpoint) -> None:
    boto3 = pytest.importorskip("boto3")

    endpoint, options = s3_endpoint
    bucket = f"tm-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)

    store = OutputStore(f"s3://{bucket}/out/", storage_options=options)
    assert not store.is_local and store.url == f"s3://{bucket}/out"
    assert store.path("shards/part-00000.jsonl") == f"s3://{bucket}/out/shards/part-00000.jsonl"
    with pytest.raises(ValueError):
        store.path("../escape")

    assert store.list() == [] and store.read_bytes("m.json") is None
    store.write_atomic("shards/part-00000.jsonl", b'{"id": "a"}\n')
    store.write_atomic("errors/part-00000.jsonl", b"")
    store.write_atomic("m.json", b"1")
    store.write_atomic("m.json", b"2")
    assert store.read_bytes("m.json") == b"2"
    assert store.exists("shards/part-00000.jsonl") and not store.exists("nope")
    assert store.list() == ["errors/part-00000.jsonl", "m.json", "shards/part-00000.jsonl"]
    assert store.list("shards/") == ["shards/part-00000.jsonl"]
    assert store.read_bytes("errors/part-00000.jsonl") == b""

    # a sibling prefix that shares the string prefix is not ours
    OutputStore(f"s3://{bucket}/outer", storage_options=options).write_atomic("x", b"x")
    assert store.list() == ["errors/part-00000.jsonl", "m.json", "shards/part-00000.jsonl"]

    store.delete("m.json")
    store.delete("m.json")
    assert not store.exists("m.json")
    assert store.list() == ["errors/part-00000.jsonl", "shards/part-00000.jsonl"]
    assert store.cleanup_temp() == 0

    # many at once (a manifest rewrite's journal records): one request, missing ones fine
    names = [f"j.d/{i:08d}.json" for i in range(5)]
    for name in names:
        store.write_atomic(name, b"{}")
    requests: list[object] = []
    rm = store.fs.rm
    store.fs.rm = lambda paths, *a, **k: requests.append(paths) or rm(paths, *a, **k)
    store.delete_many([*names, "j.d/gone.json"])
    assert len(requests) == 1 and store.list("j.d/") == []
    store.delete_many(names)  # all gone: fine


def test_writing_commits_all_or_nothing_on_s3(s3_endpoint) -> None:
    """On an object store the block's bytes are spooled locally, then uploaded whole: a
    file of ``fs.open`` would complete its upload on the block's error, a partial object."""
    fsspec = pytest.importorskip("fsspec")
    _, options = s3_endpoint
    bucket = f"tm-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", **options).mkdir(bucket)
    _written_in_a_block_or_not(OutputStore(f"s3://{bucket}/out", storage_options=options))


@pytest.mark.parametrize("glob", ["out[1]", "out?", "ou*"])
def test_deleting_many_never_reads_the_prefix_as_a_pattern(s3_endpoint, glob: str) -> None:
    """An audit: fsspec's rm expanded s3://b/out[1]/j.d/* as a pattern, deleting the journal
    records of s3://b/out1 (another job's output, its committed shards then forgotten) and
    none of its own."""
    boto3 = pytest.importorskip("boto3")
    endpoint, options = s3_endpoint
    bucket = f"tm-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing",
        aws_secret_access_key="testing", region_name="us-east-1",
    ).create_bucket(Bucket=bucket)  # fmt: skip
    names = [f"j.d/{i:08d}.json" for i in range(3)]
    mine, other = (
        OutputStore(f"s3://{bucket}/{p}", storage_options=options) for p in (glob, "out1")
    )
    for store in (mine, other):
        for name in names:
            store.write_atomic(name, b"{}")
    mine.delete_many(names)
    assert mine.list("j.d/") == [] and other.list("j.d/") == names


def test_one_output_has_one_identity_however_it_is_spelled(s3_endpoint) -> None:
    _, options = s3_endpoint
    spellings = ["s3://bkt/out", "s3://bkt/out/", "s3a://bkt/out", "s3a://bkt/out//"]
    assert len({OutputStore(url, options).identity for url in spellings}) == 1
    assert (
        OutputStore("s3://bkt/out", options).identity
        != OutputStore("s3://bkt/ou", options).identity
    )


@pytest.mark.parametrize("url", ["s3://bkt//y", "s3://bkt/o/sub/../x", "s3://bkt/z/./w"])
def test_empty_dot_and_dot_dot_segments_of_a_prefix_are_refused(s3_endpoint, url: str) -> None:
    _, options = s3_endpoint
    with pytest.raises(ValueError, match="has an empty, '.' or '..' segment"):
        OutputStore(url, options)


@pytest.mark.parametrize(("status", "code"), [(503, "SlowDown"), (500, "InternalError")])
def test_a_file_the_store_will_not_show_is_an_error_not_absent(
    faulty_s3: FaultyS3,  # noqa: F811
    status: int,
    code: str,
) -> None:
    """``exists`` over a failing HEAD: fsspec's ``isfile`` answered False ("not there")."""
    fsspec.filesystem("s3", **faulty_s3.direct).mkdir("exists-faults")
    store = OutputStore("s3://exists-faults/out", storage_options=faulty_s3.options(retries=0))
    store.write_atomic("m.json", b"{}")
    assert store.exists("m.json") and not store.exists("gone.json")
    faulty_s3.proxy.fail(status, code, methods=("HEAD",))
    with pytest.raises(OSError) as raised:
        store.exists("m.json")
    assert not isinstance(raised.value, FileNotFoundError), raised.value
    assert "s3://exists-faults/out" in str(raised.value)
    faulty_s3.proxy.clear()
    assert store.exists("m.json")


def test_a_client_error_that_takes_keywords_only_still_names_the_output() -> None:
    """botocore's ConnectTimeoutError (an OSError subclass built from keywords only) could
    not be rebuilt with a message and was re-raised as it was: a write that timed out named
    the endpoint, never the output. Its builtin type is OSError itself, so it is now a
    StorageError (a storage failure: exit 75) naming the output."""
    from botocore.exceptions import ConnectTimeoutError

    from tokenmill.io.storage import StorageError, _client_errors

    with pytest.raises(StorageError) as caught:
        with _client_errors("s3://bucket/out", "writing shards/part-00000.jsonl"):
            raise ConnectTimeoutError(endpoint_url="http://127.0.0.1:9/bucket")
    assert str(caught.value).startswith("s3://bucket/out: writing shards/part-00000.jsonl failed")
    assert "ConnectTimeoutError" in str(caught.value)
    assert isinstance(caught.value.__cause__, ConnectTimeoutError)
