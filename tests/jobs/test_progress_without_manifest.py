"""Progress the manifest does not vouch for: shards or journal records left without their
manifest are refused until --fresh, which removes them without needing the manifest; a
manifest that cannot be read exits 2 and --fresh starts over; files a run killed before
its first commit left are removed before the rows are written again (in another format or
shard size, allowed while nothing is committed). Every row ends up in the output once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.jobs.job_helpers import (
    chat_rows,
    job_dict,
    read_jsonl_dir,
    run_cli,
    write_job,
    write_jsonl,
)
from tokenmill import run_job
from tokenmill.io.storage import OutputStore
from tokenmill.jobs import shard_writer
from tokenmill.jobs.cli import main as cli_main
from tokenmill.jobs.lock import LOCK_FILE
from tokenmill.jobs.manifest import Manifest, ManifestError
from tokenmill.jobs.ownership import OWNER_FILE

ROWS = 10


def _complete_job(tiny_model: Path, tmp_path: Path, **sections) -> tuple[dict, Path]:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(ROWS))
    spec = job_dict(tiny_model, src, tmp_path / "out", **sections)
    assert run_job(spec, show_progress=False).status == "complete"
    return spec, tmp_path / "out"


def _ids_once(out: Path) -> None:
    ids = [r["id"] for r in read_jsonl_dir(out / "shards")]
    assert sorted(ids) == [r["id"] for r in chat_rows(ROWS)]


def test_shards_without_their_manifest_are_refused_until_fresh(
    tiny_model: Path, tmp_path: Path
) -> None:
    spec, out = _complete_job(tiny_model, tmp_path)  # 3 shards of 4 rows
    (out / "test.manifest.json").unlink()
    with pytest.raises(ManifestError, match=r"3 files of the progress of job 'test'.*--fresh"):
        run_job(spec, show_progress=False)
    # --fresh, with a new shard size: the old shards go, though no manifest named them.
    spec["output"]["rows_per_shard"] = 6
    report = run_job(spec, fresh=True, show_progress=False)
    assert report.status == "complete" and report.rows_this_run == ROWS
    assert sorted(p.name for p in (out / "shards").iterdir()) == [
        "part-00000.jsonl",
        "part-00001.jsonl",
    ]
    _ids_once(out)


def test_one_shard_without_its_manifest_is_one_file(tiny_model: Path, tmp_path: Path) -> None:
    """The refusal read "holds 1 files of job 'test''s progress ... which settings made them"
    (a quoted name and 's run together)."""
    spec, out = _complete_job(tiny_model, tmp_path, output={"rows_per_shard": ROWS})
    (out / "test.manifest.json").unlink()
    with pytest.raises(ManifestError, match=r"holds 1 file of the progress of job 'test' \(") as (
        refused
    ):
        run_job(spec, show_progress=False)
    assert "them" not in str(refused.value) and "''s" not in str(refused.value)


def test_journal_records_without_their_manifest_are_refused(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A journal left by another run's settings must never be merged into a new manifest."""
    spec, out = _complete_job(tiny_model, tmp_path)
    record = json.loads((out / "test.manifest.json").read_text())["shards"]["0"]
    journal = out / "test.manifest.d"
    journal.mkdir(exist_ok=True)
    (journal / "00000000.json").write_text(json.dumps(record))
    for shard in (out / "shards").iterdir():
        shard.unlink()
    (out / "test.manifest.json").unlink()
    with pytest.raises(ManifestError, match="00000000.json"):
        run_job(spec, show_progress=False)
    assert run_job(spec, fresh=True, show_progress=False).rows_this_run == ROWS
    assert not list(journal.iterdir())
    _ids_once(out)


def test_an_output_emptied_under_its_run_exits_2_naming_fresh_and_fresh_completes(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """An audit: ``rm -rf out/*`` while a job ran (the glob keeps ``.tokenmill.lock``, so the
    run goes on) took its ownership record and manifest; the run committed more shards and
    journal records, and its rerun was refused as an output holding files "job 'test' did not
    write", with --fresh as well. The journal is the job's own: the rerun asks for --fresh."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(ROWS))
    out = tmp_path / "out"
    job = write_job(tmp_path, job_dict(tiny_model, src, out, output={"rows_per_shard": 2}))
    commit = shard_writer.commit_shard

    def emptied_before_shard_3(store: OutputStore, shard: int, *args, **kwargs):
        if shard == 3:  # shards 0-2 committed: the user's rm -rf out/* lands here
            for path in out.iterdir():
                if path.name != LOCK_FILE:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        return commit(store, shard, *args, **kwargs)

    monkeypatch.setattr(shard_writer, "commit_shard", emptied_before_shard_3)
    assert run_cli(job, "--quiet") == 1  # its committed shards went: not complete
    monkeypatch.undo()
    assert list((out / "test.manifest.d").iterdir()) and not (out / OWNER_FILE).exists()
    capsys.readouterr()

    assert run_cli(job, "--quiet") == 2
    said = capsys.readouterr().err
    assert str(out) in said and "--fresh" in said and "did not write" not in said, said
    assert run_cli(job, "--quiet", "--fresh") == 0
    _ids_once(out)


def test_an_unreadable_manifest_exits_2_and_fresh_starts_over(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    spec, out = _complete_job(tiny_model, tmp_path)
    job_file = tmp_path / "job.json"  # (JSON is YAML)
    job_file.write_text(json.dumps(spec))
    # A copy of a record under another name in the journal's folder is not a record.
    (out / "test.manifest.d").mkdir(exist_ok=True)
    (out / "test.manifest.d" / "00000003.json.bak").write_text("{}")
    assert cli_main([str(job_file), "--quiet"]) == 0
    manifest = out / "test.manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    assert cli_main([str(job_file), "--quiet"]) == 2
    assert "--fresh" in capsys.readouterr().err
    assert cli_main([str(job_file), "--quiet", "--fresh"]) == 0
    _ids_once(out)


@pytest.mark.parametrize("change", [{"format": "parquet"}, {"rows_per_shard": 6}])
def test_files_of_a_run_killed_before_its_first_commit_are_removed(
    tiny_model: Path, tmp_path: Path, change: dict
) -> None:
    """The run wrote shard 2's data file and was killed before naming it: its manifest has
    no shard, so the next run may change the format or the shard size."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(ROWS))
    out = tmp_path / "out"
    store = OutputStore(str(out), owner="test")
    Manifest("test", "an earlier fingerprint", 4).save(store)
    (out / "shards").mkdir()
    (out / "shards" / "part-00002.jsonl").write_text('{"id": "r0008", "text": "old"}\n')
    report = run_job(job_dict(tiny_model, src, out, output=change), show_progress=False)
    assert report.status == "complete" and report.rows_ok == ROWS
    if "format" in change:
        assert not list((out / "shards").glob("*.jsonl"))
        assert len(list((out / "shards").glob("*.parquet"))) == 3
    else:
        _ids_once(out)
