"""A job refused because its input changed names the files added, gone or changed."""

from __future__ import annotations

import functools
import http.server
import importlib
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.jobs.job_helpers import chat_rows, job_dict, write_jsonl
from tokenmill import run_job
from tokenmill.io.readers import InputConfig, fingerprint_input, list_input_files
from tokenmill.jobs import runner
from tokenmill.jobs.dry_run import dry_run
from tokenmill.jobs.fingerprint import fingerprint
from tokenmill.jobs.input_changes import file_changes
from tokenmill.jobs.manifest import FingerprintMismatchError, InputChangedError, Manifest
from tokenmill.jobs.preflight import check_up_front
from tokenmill.jobs.spec import JobSpec

# the module (tokenmill.io.readers exports a function of the same name)
fingerprints = importlib.import_module("tokenmill.io.readers.input_fingerprint")


def test_file_changes_names_each_kind_and_counts_the_rest() -> None:
    before = {"s3://b/a": "1", "s3://b/b": "2", "s3://b/c": "3"}
    after = {"s3://b/a": "1", "s3://b/b": "9", **{f"s3://b/n{i}": "0" for i in range(5)}}
    assert file_changes(before, after) == [
        "input files added: s3://b/n0, s3://b/n1, s3://b/n2 (and 2 more)",
        "input files gone: s3://b/c",
        "input files changed: s3://b/b",
    ]
    assert file_changes(before, dict(before)) == []
    secret = file_changes({}, {"https://user:hunter2@host/x.jsonl": "1"})
    assert secret and "hunter2" not in secret[0]


def _folder_job(tiny_model: Path, tmp_path: Path) -> tuple[Path, dict]:
    folder = tmp_path / "in"
    write_jsonl(folder / "a.jsonl", chat_rows(2))
    write_jsonl(folder / "b.jsonl", chat_rows(2, start=10))
    spec = job_dict(tiny_model, folder, tmp_path / "out")
    assert run_job(spec, show_progress=False).status == "complete"
    return folder, spec


def test_a_new_file_in_the_input_folder_is_named(tiny_model: Path, tmp_path: Path) -> None:
    folder, spec = _folder_job(tiny_model, tmp_path)
    added = write_jsonl(folder / "c.jsonl", chat_rows(1, start=20))
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(spec, show_progress=False)
    message = str(info.value)
    assert f"input files added: {added}" in message, message
    assert "input_files.files: 2 -> 3 (input files)" in message  # the counts as before
    report = dry_run(JobSpec.from_dict(spec))  # the dry run says it too
    assert report.resumable is False
    assert f"changed since   input files added: {added}" in report.summary()


def test_a_rewritten_and_a_removed_file_are_named(tiny_model: Path, tmp_path: Path) -> None:
    folder, spec = _folder_job(tiny_model, tmp_path)
    write_jsonl(folder / "a.jsonl", chat_rows(3))
    (folder / "b.jsonl").unlink()
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(spec, show_progress=False)
    message = str(info.value)
    assert f"input files changed: {folder / 'a.jsonl'}" in message, message
    assert f"input files gone: {folder / 'b.jsonl'}" in message


def test_a_manifest_without_file_entries_says_the_counts(tiny_model: Path, tmp_path: Path) -> None:
    """A job begun before the entries were kept (or with more input files than are named)
    is refused as before, by the counts."""
    folder, spec = _folder_job(tiny_model, tmp_path)
    path = tmp_path / "out" / "test.manifest.json"
    manifest = json.loads(path.read_text())
    assert set(manifest["settings"]["input_entries"]) == {
        str(folder / "a.jsonl"),
        str(folder / "b.jsonl"),
    }
    del manifest["settings"]["input_entries"]
    path.write_text(json.dumps(manifest))
    write_jsonl(folder / "c.jsonl", chat_rows(1, start=20))
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(spec, show_progress=False)
    assert "input files added" not in str(info.value)
    assert "input_files.files: 2 -> 3" in str(info.value)


def test_past_the_named_files_limit_no_entries_are_kept(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fingerprints, "MAX_NAMED_FILES", 1)
    folder, spec = _folder_job(tiny_model, tmp_path)
    manifest = json.loads((tmp_path / "out" / "test.manifest.json").read_text())
    assert "input_entries" not in manifest["settings"]
    assert manifest["settings"]["input_files"]["files"] == 2


@pytest.fixture
def http_folder(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(address, folder): an http://127.0.0.1 server over a folder holding ``rows.jsonl``
    (query strings ignored, as a presigned URL's are by the store)."""
    folder = tmp_path / "srv"
    write_jsonl(folder / "rows.jsonl", chat_rows(2))
    handler = functools.partial(_Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}", folder
    server.shutdown()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def test_entries_keep_no_token_and_no_password(http_folder: tuple[str, Path]) -> None:
    """A presigned URL's signature and a URL's password stay out of the manifest's entries,
    and a new token or password for the same file changes no entry (the file is the same)."""
    address, _ = http_folder

    def entries(url: str) -> dict[str, str]:
        return fingerprint_input(InputConfig(path=url, format="jsonl", prompt_column="x")).entries

    first = entries(f"http://u:pw1@{address}/rows.jsonl?X-Amz-Signature=SIGSECRET1")
    assert list(first) == [f"http://u:***@{address}/rows.jsonl"]
    assert first == entries(f"http://u:pw2@{address}/rows.jsonl?X-Amz-Signature=SIGSECRET2")


def test_a_file_gone_by_the_end_check_is_named(tiny_model: Path, tmp_path: Path) -> None:
    """An input file deleted while the run read it: the end check's InputChangedError names
    it (it raised a bare FileNotFoundError)."""
    folder = tmp_path / "in"
    write_jsonl(folder / "a.jsonl", chat_rows(2))
    gone = write_jsonl(folder / "b.jsonl", chat_rows(2, start=10))
    cfg = InputConfig(path=str(folder), messages_column="messages", prompt_column=None)
    cfg = replace(cfg, files=tuple(list_input_files(cfg)))
    start = fingerprint_input(cfg)
    settings = {"input": start.digest, "input_files": start.counts, "input_entries": start.entries}
    gone.unlink()
    with pytest.raises(InputChangedError, match=f"input files gone: {gone}"):
        runner._check_input_unchanged(cfg, Manifest("test", "fp", 1, settings=settings))


def test_a_regenerated_presigned_url_resumes(tiny_model: Path, tmp_path: Path, http_folder) -> None:
    """The same file under a new signature (a presigned URL expires): the entries say the file
    is the same, and so must the input's hash."""
    address, _ = http_folder
    url = f"http://{address}/rows.jsonl"
    spec = job_dict(tiny_model, url + "?X-Amz-Signature=SIG1", tmp_path / "out")
    spec["input"]["format"] = "jsonl"
    assert run_job(spec, show_progress=False).status == "complete"
    manifest = json.loads((tmp_path / "out" / "test.manifest.json").read_text())
    manifest["complete"] = False  # as if stopped after its shards
    (tmp_path / "out" / "test.manifest.json").write_text(json.dumps(manifest))
    spec["input"]["path"] = url + "?X-Amz-Signature=SIG2"
    report = run_job(spec, show_progress=False)
    assert report.status == "complete"


def test_a_hash_sign_in_local_file_names_keeps_each_file_apart(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Only an HTTP(S) URL loses its query string and fragment in the manifest: local (and
    object) names may hold "#" or "?", and two such files stay two entries."""
    folder = tmp_path / "in"
    write_jsonl(folder / "part#1.jsonl", chat_rows(2))
    write_jsonl(folder / "part#2.jsonl", chat_rows(2, start=10))
    spec = job_dict(tiny_model, folder, tmp_path / "out")
    assert run_job(spec, show_progress=False).status == "complete"
    manifest = json.loads((tmp_path / "out" / "test.manifest.json").read_text())
    assert len(manifest["settings"]["input_entries"]) == 2
    write_jsonl(folder / "part#1.jsonl", chat_rows(3))
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(spec, show_progress=False)
    assert f"input files changed: {folder / 'part#1.jsonl'}" in str(info.value), str(info.value)


def test_a_presigned_signature_stays_out_of_the_changed_input_error(
    tiny_model: Path, tmp_path: Path, http_folder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The input rewritten while the run reads it: the InputChangedError (and report.json,
    which keeps it) leave the presigned URL's signature out, as the manifest does."""
    address, folder = http_folder
    spec = job_dict(
        tiny_model, f"http://{address}/rows.jsonl?X-Amz-Signature=SIGSECRET", tmp_path / "out"
    )
    spec["input"]["format"] = "jsonl"
    load = runner._count_and_load

    def load_then_rewrite(*args, **kwargs):
        loaded = load(*args, **kwargs)
        write_jsonl(folder / "rows.jsonl", chat_rows(3))
        return loaded

    monkeypatch.setattr(runner, "_count_and_load", load_then_rewrite)
    with pytest.raises(InputChangedError) as info:
        run_job(spec, show_progress=False)
    assert "SIGSECRET" not in str(info.value), str(info.value)
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert "SIGSECRET" not in path.read_text(errors="replace"), path


def test_the_dry_run_says_what_the_run_does_before_a_first_shard(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Progress without a shard is no progress to a run (it starts over, refusing nothing):
    the dry run must not say the run will be refused and list changes."""
    folder = tmp_path / "in"
    write_jsonl(folder / "a.jsonl", chat_rows(2))
    spec = job_dict(tiny_model, folder, tmp_path / "out")
    assert run_job(spec, show_progress=False).status == "complete"
    path = tmp_path / "out" / "test.manifest.json"
    manifest = json.loads(path.read_text())
    manifest["complete"], manifest["shards"] = False, {}
    path.write_text(json.dumps(manifest))
    write_jsonl(folder / "b.jsonl", chat_rows(2, start=10))
    report = dry_run(JobSpec.from_dict(spec))
    assert "use --fresh" not in report.summary() and not report.changed, report.summary()
    assert run_job(spec, show_progress=False).status == "complete"  # the run refuses nothing


def test_a_job_begun_when_signed_urls_were_hashed_whole_resumes(
    tiny_model: Path, tmp_path: Path, http_folder: tuple[str, Path]
) -> None:
    """Versions before 5d2d81c hashed an HTTP(S) URL whole (its query string, a password):
    a job they began over a presigned URL resumes under the same URL after an upgrade (it
    was refused, "the input changed", the input the same: --fresh recomputed every row)."""
    address, folder = http_folder
    write_jsonl(folder / "rows.jsonl", chat_rows(8))
    url = f"http://u:pw@{address}/rows.jsonl?X-Amz-Signature=SIG1"
    spec = job_dict(tiny_model, url, tmp_path / "out")
    spec["input"]["format"] = "jsonl"
    assert run_job(spec, show_progress=False).status == "complete"
    cfg = check_up_front(JobSpec.from_dict(spec))
    settings, _ = runner.settings_of(JobSpec.from_dict(spec), cfg)
    # the input's digest as those versions took it: each file's entry with the URL whole
    how = {"v": 1, "format": "jsonl", "passthrough": cfg.passthrough_columns}
    how |= {"id": cfg.id_column, "prompt": cfg.prompt_column, "messages": cfg.messages_column}
    digest = fingerprints.hashlib.sha256(json.dumps(how, sort_keys=True).encode())
    content = (folder / "rows.jsonl").read_bytes()
    edge = fingerprints.hashlib.sha256(content).hexdigest()
    digest.update(json.dumps([url, len(content), edge, edge]).encode())
    earlier = fingerprint({**settings, "input": digest.hexdigest()})
    path = tmp_path / "out" / "test.manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["fingerprint"] != earlier  # (the hash this version gives differs)
    manifest["fingerprint"], manifest["complete"] = earlier, False
    del manifest["shards"]["1"]  # as if stopped after its first shard
    path.write_text(json.dumps(manifest))
    report = run_job(spec, show_progress=False)
    assert report.status == "complete"
    assert (report.rows_resumed, report.rows_this_run) == (4, 4)
    assert json.loads(path.read_text())["fingerprint"] == fingerprint(settings)
    assert dry_run(JobSpec.from_dict(spec)).changed == []
