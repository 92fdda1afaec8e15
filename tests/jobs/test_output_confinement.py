"""A job writes and deletes only below its output.path: never through a symbolic link planted
inside it, and never into the model folder it reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.jobs.job_helpers import chat_rows, job_dict, read_jsonl_dir, write_jsonl
from tokenmill import run_job
from tokenmill.jobs.lock import LOCK_FILE, JobLock
from tokenmill.jobs.output_location import OutputPathError


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "important.txt").write_text("keep me")
    return victim


@pytest.mark.parametrize("dangling", [False, True])
def test_a_linked_lock_file_is_refused_and_its_target_untouched(
    tiny_model: Path, tmp_path: Path, dangling: bool
) -> None:
    victim = _victim(tmp_path)
    target = victim / ("created.txt" if dangling else "important.txt")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(target)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    with pytest.raises(OutputPathError, match=LOCK_FILE):
        run_job(job_dict(tiny_model, src, out), show_progress=False)
    assert sorted(p.name for p in victim.iterdir()) == ["important.txt"]
    assert (victim / "important.txt").read_text() == "keep me"


def test_the_lock_itself_never_opens_a_link(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(victim / "important.txt")
    with pytest.raises(OutputPathError, match="symbolic link"):
        JobLock("job", str(out), str(out)).acquire()
    assert (victim / "important.txt").read_text() == "keep me"


def test_a_full_disk_as_the_lock_is_taken_leaves_it_free(tmp_path: Path, monkeypatch) -> None:
    """ENOSPC writing the holder's line into the lock file (a full disk) failed the run but
    kept the lock held and registered in this process: once space was freed, every later
    run_job or submit() of the job in this process was refused as "being written by job
    't' in this process" (an audit)."""
    import errno

    from tokenmill.jobs import lock as lock_module

    out = tmp_path / "out"

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock_module.os, "write", full)
    with pytest.raises(OSError, match=LOCK_FILE):
        JobLock("t", str(out), str(out)).acquire()
    monkeypatch.undo()
    assert not out.exists()  # the folder it made, and the empty lock file, are gone
    with JobLock("t", str(out), str(out)):  # free again, in this process too
        assert (out / LOCK_FILE).read_text().startswith("job 't'")


@pytest.mark.parametrize("fresh", [False, True])
def test_a_linked_folder_inside_the_output_is_refused(
    tiny_model: Path, tmp_path: Path, fresh: bool
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "part-00003.parquet").write_text("not the job's")
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    out = tmp_path / "out"
    assert run_job(job_dict(tiny_model, src, out), show_progress=False).status == "complete"
    os.rename(out / "shards", tmp_path / "moved")
    (out / "shards").symlink_to(elsewhere)
    with pytest.raises(OutputPathError, match="shards"):
        run_job(job_dict(tiny_model, src, out), fresh=fresh, show_progress=False)
    assert [p.name for p in elsewhere.iterdir()] == ["part-00003.parquet"]


def test_an_output_path_that_is_itself_a_link_is_fine(tiny_model: Path, tmp_path: Path) -> None:
    real = tmp_path / "disk" / "out"
    real.mkdir(parents=True)
    (tmp_path / "out").symlink_to(real)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    report = run_job(job_dict(tiny_model, src, tmp_path / "out"), show_progress=False)
    assert report.status == "complete"
    assert len(read_jsonl_dir(real / "shards")) == 4


@pytest.mark.parametrize("inside", ["", "results"])
def test_output_in_the_model_folder_is_refused(
    tiny_model: Path, tmp_path: Path, inside: str
) -> None:
    before = sorted(p.name for p in tiny_model.iterdir())
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    with pytest.raises(OutputPathError, match="model folder"):
        run_job(job_dict(tiny_model, src, tiny_model / inside), show_progress=False)
    assert sorted(p.name for p in tiny_model.iterdir()) == before


def test_an_output_path_under_a_file_is_refused_naming_it(tiny_model: Path, tmp_path: Path) -> None:
    """It failed with NotADirectoryError and "committed shards are kept; rerun", naming
    neither output.path nor the file in the way."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(1))
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    spec = job_dict(tiny_model, src, blocker / "out" / "run1")
    with pytest.raises(
        OutputPathError, match=r"output.path .* is under '.*notes.txt', which is a file"
    ):
        run_job(spec, show_progress=False)


@pytest.mark.parametrize("spelling", ["tilde", "file_url"])
def test_output_in_the_model_folder_is_refused_however_spelled(
    tiny_model: Path, tmp_path: Path, monkeypatch, spelling: str
) -> None:
    """``~/m`` (model.source and output.path) and ``file:///.../m`` name the model folder as
    its plain path does; the check compared the text and let the job write among the model's
    files (its next run refused: the model's fingerprint had changed)."""
    home = tmp_path / "home"
    home.mkdir()
    model = home / "m"
    model.mkdir()
    for file in tiny_model.iterdir():
        if file.is_file():
            (model / file.name).write_bytes(file.read_bytes())
    monkeypatch.setenv("HOME", str(home))
    before = sorted(p.name for p in model.iterdir())
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    spec = job_dict(model, src, model)
    if spelling == "tilde":
        spec["model"]["source"] = spec["output"]["path"] = "~/m"
    else:
        spec["output"]["path"] = f"file://{model}"
    with pytest.raises(OutputPathError, match="model folder"):
        run_job(spec, show_progress=False)
    assert sorted(p.name for p in model.iterdir()) == before
