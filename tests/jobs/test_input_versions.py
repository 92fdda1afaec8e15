"""An object-storage input rewritten in its middle at the same size: the input's hash reads
each file's first and last MiB only, so the object's version (S3's ETag) tells it, and a
resume that would mix rows of the old content and the new is refused. (The edges are made
``_EDGE`` bytes here, so that small files have a middle.)"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3fs

from tests.jobs.job_helpers import chat_rows, job_dict, write_jsonl
from tests.s3_server import s3_endpoint  # noqa: F401
from tokenmill import run_job
from tokenmill.io.readers import InputConfig, fingerprint_input, list_input_files, listing_cache
from tokenmill.io.readers.input_fingerprint import content_version
from tokenmill.jobs import runner
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.fingerprint import changed_settings, fingerprint, same_content
from tokenmill.jobs.manifest import FingerprintMismatchError, InputChangedError, Manifest
from tokenmill.jobs.spec import JobSpec

URL = "s3://jobs/in/rows.jsonl"
_EDGE = 512  # input_fingerprint.EDGE_BYTES in these tests


def _rows(middle: str) -> bytes:
    """Three rows: the first and last padded past ``_EDGE`` bytes each, so the middle one
    (``middle`` its question) lies outside both edges the input's hash reads."""
    rows = chat_rows(3)
    rows[0]["pad"] = rows[2]["pad"] = "x" * _EDGE
    rows[1]["messages"][0]["content"] = middle
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


OLD, NEW = _rows("what is 2 + 2?"), _rows("what is 3 + 3?")  # same size, same edges


@contextlib.contextmanager
def _manifest(out: Path) -> Iterator[dict[str, Any]]:
    """Job 'test''s manifest in ``out`` as a dict to edit; written back on leaving."""
    path = out / "test.manifest.json"
    manifest = json.loads(path.read_text())
    yield manifest
    path.write_text(json.dumps(manifest))


@pytest.fixture(autouse=True)
def _small_edges(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("tokenmill.io.readers.input_fingerprint")  # (not the function)
    monkeypatch.setattr(module, "EDGE_BYTES", _EDGE)
    assert len(OLD) > 2 * _EDGE and OLD[:_EDGE] == NEW[:_EDGE] and OLD[-_EDGE:] == NEW[-_EDGE:]


@pytest.fixture
def s3_job(s3_endpoint, tmp_path: Path, tiny_model: Path) -> tuple[Any, dict[str, Any]]:  # noqa: F811
    """(filesystem, job spec): a job over ``URL`` (holding OLD), its output local."""
    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir("jobs")
    fs.pipe_file(URL, OLD)
    spec = job_dict(tiny_model, URL, tmp_path / "out", sampling={"max_tokens": 1})
    spec["input"]["storage_options"] = options
    return fs, spec


def test_an_object_rewritten_in_its_middle_is_refused(s3_job, tmp_path: Path) -> None:
    fs, spec = s3_job
    assert run_job(spec, show_progress=False).status == "complete"
    etag = fs.info(URL)["ETag"].strip('"')
    with _manifest(tmp_path / "out") as manifest:
        assert manifest["settings"]["input_versions"] == {URL: etag}
        manifest["complete"] = False  # stopped part way
    fs.pipe_file(URL, OLD)  # uploaded again as it was: the same ETag, the job resumes
    assert run_job(spec, show_progress=False).status == "complete"

    fs.pipe_file(URL, NEW)
    new = fs.info(URL)["ETag"].strip('"')
    # the dry run says what the run will do (it said "resumable", 3 rows already done)
    report = dry_run(JobSpec.from_dict(spec))
    assert report.resumable is False and "another fingerprint: use --fresh" in report.summary()
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(spec, show_progress=False)
    message = str(info.value)
    assert f'input_versions.{URL}: "{etag}" -> "{new}" (written again in storage' in message
    assert "input:" not in message  # its hash did not see it
    assert "--fresh" in message and "output.path elsewhere" in message


def _rewrite_once_loaded(monkeypatch: pytest.MonkeyPatch, fs: Any) -> None:
    """Make the run's input NEW (through ``fs``, another client) once the run has loaded
    the model and counted the rows: while it reads them."""
    load = runner._count_and_load

    def load_then_rewrite(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        fs.pipe_file(URL, NEW)
        return loaded

    monkeypatch.setattr(runner, "_count_and_load", load_then_rewrite)


def test_an_object_rewritten_while_a_run_reads_it(
    s3_job, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fs, spec = s3_job
    _rewrite_once_loaded(monkeypatch, fs)
    with pytest.raises(InputChangedError, match=f"{URL} written again in storage"):
        run_job(spec, show_progress=False)
    with _manifest(tmp_path / "out") as manifest:
        assert not manifest.get("complete")


def test_a_listing_and_a_head_give_one_version(s3_endpoint) -> None:  # noqa: F811
    """s3fs answers info from a listing it cached, else from a HEAD: both quote the ETag,
    and a multipart upload's ("md5-parts") reads the same both ways."""
    _, options = s3_endpoint
    options = {k: v for k, v in options.items() if k != "skip_instance_cache"}
    fs = fsspec.filesystem("s3", **options, skip_instance_cache=True)
    fs.mkdir("jobs")
    fs.pipe_file("jobs/in/a.jsonl", OLD)
    fs.pipe_file("jobs/in/b.jsonl", b"{}\n" * (4 << 20), chunksize=5 << 20)  # two parts
    for name in ("a.jsonl", "b.jsonl"):
        fs.invalidate_cache()
        head = content_version(fs, fs.info(f"jobs/in/{name}"))
        fs.ls("jobs/in", detail=True)  # the listing, cached: info answers from it
        listed = content_version(fs, fs.info(f"jobs/in/{name}"))
        assert head == listed and head is not None and '"' not in head
    assert head is not None and head.rsplit("-", 1)[1].isdigit()  # "md5-parts"

    # A check for changes asks the store again, not the listing cached at the start.
    cfg = InputConfig(path="s3://jobs/in/", prompt_column="x", storage_options=options)
    try:
        cfg = replace(cfg, files=tuple(list_input_files(cfg)))  # as a run lists it, once
        first = fingerprint_input(cfg).versions
        fs.pipe_file("jobs/in/a.jsonl", NEW)  # (another instance: the run's cache stays)
        fresh = fingerprint_input(cfg, fresh=True)
        assert fresh.versions["s3://jobs/in/a.jsonl"] != first["s3://jobs/in/a.jsonl"]
        assert fresh.digest == fingerprint_input(replace(cfg, files=None)).digest  # (its edges)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_local_files_have_no_versions(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(2))
    cfg = InputConfig(path=str(src), messages_column="messages", prompt_column=None)
    assert fingerprint_input(cfg).versions == {}


class _Store:
    def __init__(self, protocol: str | tuple[str, ...]) -> None:
        self.protocol = protocol


@pytest.mark.parametrize(
    ("protocol", "info", "version"),
    [
        (("s3", "s3a"), {"ETag": '"abc-3"'}, "abc-3"),
        (("gs", "gcs"), {"md5Hash": "q2b==", "generation": "17"}, "q2b=="),
        (("gs", "gcs"), {"generation": "17"}, "17"),  # a composed object has no MD5
        (("abfs", "az", "abfss"), {"etag": '"0x8DC"'}, "0x8DC"),
        ("file", {"mtime": 1.5}, None),
        (("http", "https"), {"ETag": 'W/"5f-1a"'}, None),  # often made of the mtime
    ],
)
def test_content_versions(protocol: Any, info: dict[str, Any], version: str | None) -> None:
    assert content_version(_Store(protocol), info) == version  # type: ignore[arg-type]


_VERSIONS = {"input_versions": {"s3://b/p.v1/a.jsonl": "1"}}


def test_a_changed_version_is_named_and_a_file_added_is_not() -> None:
    old = {"input": "h", **_VERSIONS}
    new = {"input": "h", "input_versions": {"s3://b/p.v1/a.jsonl": "2"}}
    assert not same_content(old, new)
    (line,) = changed_settings(old, new)
    assert line.startswith('input_versions.s3://b/p.v1/a.jsonl: "1" -> "2" (written again')
    added = {"input": "h2", "input_versions": {**old["input_versions"], "s3://b/b.jsonl": "3"}}
    assert [line.split(":")[0] for line in changed_settings(old, added)] == ["input"]


def test_a_manifest_without_versions_resumes() -> None:
    """A job begun before versions were kept (or on local files) resumes; from then on its
    manifest has them (runner: ``manifest.settings = record``)."""
    settings = {"input": "h", "input_files": {"files": 1, "bytes": 9}}
    manifest = Manifest("test", fingerprint(settings), 4, settings=settings)
    manifest.check_fingerprint(fingerprint(settings), {**settings, **_VERSIONS}, "out")
    with pytest.raises(FingerprintMismatchError, match=r"input_versions\.s3://b/p\.v1/a"):
        manifest.settings = {**settings, **_VERSIONS}
        changed = {"input_versions": {"s3://b/p.v1/a.jsonl": "2"}}
        manifest.check_fingerprint(fingerprint(settings), {**settings, **changed}, "out")


def _three_objects(s3_endpoint: tuple[str, dict[str, Any]], bucket: str):  # noqa: F811
    """(filesystem, input config): objects a, b and c holding OLD in ``bucket``'s in/."""
    _, options = s3_endpoint
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir(bucket)
    for name in "abc":
        fs.pipe_file(f"{bucket}/in/{name}.jsonl", OLD)
    return fs, InputConfig(path=f"s3://{bucket}/in/", prompt_column="x", storage_options=options)


def test_many_objects_keep_one_digest_of_their_versions(
    s3_endpoint,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_NAMED_VERSIONS files the manifest keeps one digest, not a line a file (it is
    rewritten as a long job goes); a rewritten object still changes it."""
    module = importlib.import_module("tokenmill.io.readers.input_fingerprint")
    monkeypatch.setattr(module, "MAX_NAMED_VERSIONS", 2)
    fs, cfg = _three_objects(s3_endpoint, "many")
    before = fingerprint_input(cfg).versions
    fs.pipe_file("many/in/b.jsonl", NEW)
    after = fingerprint_input(cfg, fresh=True).versions
    assert list(before) == list(after) == ["any of 3 objects"] and before != after
    (line,) = changed_settings({"input_versions": before}, {"input_versions": after})
    assert line.startswith("input_versions.any of 3 objects: ") and "written again" in line


@pytest.fixture
def user_client(s3_endpoint, tmp_path: Path, tiny_model: Path):  # noqa: F811
    """(another client, job spec) with storage options as a user gives them: one s3fs
    client for the process, its listings cached across runs (the other fixtures make a
    client a call); the object written by another client, as another program would."""
    _, options = s3_endpoint
    user = {k: v for k, v in options.items() if k != "skip_instance_cache"}
    other = fsspec.filesystem("s3", **options)
    other.mkdir("jobs")
    other.pipe_file(URL, OLD)
    spec = job_dict(tiny_model, "s3://jobs/in/", tmp_path / "out", sampling={"max_tokens": 1})
    spec["input"]["storage_options"] = user
    yield other, spec
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_run_lists_the_store_as_it_is_now(user_client) -> None:
    """A dry run, the object rewritten, then a fresh run in the same process: the client's
    cached listing had the old ETag, so the run could not read the object ("cannot be
    reached (FileExpired ...)", exit 75, again at every retry in that process)."""
    other, spec = user_client
    assert dry_run(JobSpec.from_dict(spec)).rows == 3
    other.pipe_file(URL, NEW)
    assert run_job(spec, fresh=True, show_progress=False).status == "complete"


def test_an_object_rewritten_mid_run_is_the_input_changing(
    user_client, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """s3fs reads with the ETag it listed: an object rewritten while the run reads it fails
    its read ("FileExpired", a raw client error); it is the input changing under the run."""
    other, spec = user_client
    _rewrite_once_loaded(monkeypatch, other)
    with pytest.raises(InputChangedError, match="changed while this run read it .*FileExpired|"
                       "changed while this run read it .*no longer exists"):  # fmt: skip
        run_job(spec, show_progress=False)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "failed" and "InputChangedError" in report["error"]


@contextlib.contextmanager
def _requests() -> Iterator[list[str]]:
    """The requests the S3 server answers meanwhile ("HEAD /bucket/key ..."), from its
    request log."""
    seen: list[str] = []

    class Log(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.extend(re.findall(r'"([A-Z]+ /[^"]*)"', record.getMessage()))

    log, handler = logging.getLogger("werkzeug"), Log()
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@pytest.mark.parametrize("list_past", [listing_cache.LIST_FOLDER_PAST, 1000])
def test_the_end_check_lists_a_busy_folder_once(
    s3_endpoint,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    list_past: int,
) -> None:
    """The check at a run's end asks the store again: a folder of many input files is
    listed once (a request per 1,000 files), not asked about file by file (a HEAD each,
    two before the fingerprint took the open's: 20,000 requests for 10,000 files); a folder
    of few (here: past 1,000) file by file."""
    monkeypatch.setattr(listing_cache, "LIST_FOLDER_PAST", list_past)
    files = 20
    assert listing_cache.LIST_FOLDER_PAST < files or list_past == 1000
    _, options = s3_endpoint
    user = {k: v for k, v in options.items() if k != "skip_instance_cache"}
    other = fsspec.filesystem("s3", **options)
    other.mkdir("busy")
    for i in range(files):
        other.pipe_file(f"busy/in/{i:03}.jsonl", OLD)
    cfg = InputConfig(path="s3://busy/in/", prompt_column="x", storage_options=user)
    try:
        cfg = replace(cfg, files=tuple(list_input_files(cfg)))
        other.pipe_file("busy/in/007.jsonl", NEW)
        with _requests() as seen:
            versions = fingerprint_input(cfg, fresh=True).versions
        heads = sum(line.startswith("HEAD /busy/in/") for line in seen)
        assert len(versions) == files
        assert heads == (0 if list_past < files else files + 1)  # (opens; the format's look)
        now = other.info("busy/in/007.jsonl")["ETag"].strip('"')
        assert versions["s3://busy/in/007.jsonl"] == now
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_the_end_check_reads_no_file_while_every_version_holds(
    s3_endpoint,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At a run's end the input is checked against its start: where every object's version
    and size are as they were, the listing says so and no file is read again (the check
    read each file's first and last MiB again: as many bytes as the start read); an object
    rewritten at its size is still found, by its version."""
    module = importlib.import_module("tokenmill.io.readers.input_fingerprint")
    fs, cfg = _three_objects(s3_endpoint, "ends")
    cfg = replace(cfg, files=tuple(list_input_files(cfg)))
    start = fingerprint_input(cfg)
    settings = {"input": start.digest, "input_files": start.counts}
    manifest = Manifest("test", "fp", 1, settings={**settings, "input_versions": start.versions})
    reads: list[str] = []
    read = module._file_entry
    monkeypatch.setattr(module, "_file_entry", lambda url, *a: reads.append(url) or read(url, *a))
    runner._check_input_unchanged(cfg, manifest)
    assert reads == []
    # without versions kept (a manifest of before, local files) the files are read
    runner._check_input_unchanged(cfg, Manifest("test", "fp", 1, settings=settings))
    assert len(reads) == 3
    fs.pipe_file("ends/in/b.jsonl", NEW)  # same size, same edges: only its version tells
    with pytest.raises(InputChangedError, match="ends/in/b.jsonl"):
        runner._check_input_unchanged(cfg, manifest)


def test_a_key_with_a_space_rewritten_mid_run_is_the_input_changing() -> None:
    """An audit: s3fs's message names the key ("filename b/in/my rows.jsonl and Etag ..."),
    and a pattern of non-spaces missed one with a space: a plain store error (exit 75,
    "retry") instead of the input changing."""
    from tokenmill.io.readers import InputConfig
    from tokenmill.jobs.runner import _rewritten_while_read

    class FileExpired(OSError):  # s3fs's, by name
        pass

    cfg = InputConfig(path="s3://b/in/", files=("s3://b/in/a.jsonl", "s3://b/in/my rows.jsonl"))
    said = 'The remote file corresponding to filename b/in/my rows.jsonl and Etag "33f7" no longer'
    failure = RuntimeError("reading failed")
    failure.__cause__ = FileExpired(16, said)
    assert isinstance(_rewritten_while_read(failure, cfg), InputChangedError)
    other = RuntimeError("reading failed")
    other.__cause__ = FileExpired(16, said.replace("my rows", "other rows"))
    assert _rewritten_while_read(other, cfg) is None
