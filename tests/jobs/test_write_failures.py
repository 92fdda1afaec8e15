"""A run whose output writes fail: at each file a job writes (a shard's data file, its error
file, the manifest's journal record, the manifest, report.html, report.json) and at each step
of a local write (opening the temporary file, writing it, renaming it over the final name).

The failures are those of a full disk (ENOSPC), a failing disk (EIO), a folder made
read-only mid-run (EACCES; chmod does not stop root, so the open is refused here) and a
read-only file system (EROFS: a read-only mount, or a disk remounted read-only). Once a
write has failed, every later one into the output fails too, as on a full disk, until the
fault is removed. Each run must exit with README's code (75 temporary, 2 for a permission or
a read-only file system to fix), say which file and why without a traceback, commit only
readable files, leave no temporary file behind, and its rerun must complete with each input
row exactly once.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from tests.jobs.job_helpers import (
    chat_rows,
    committed_shards,
    job_dict,
    run_cli,
    write_job,
    write_jsonl,
)
from tokenmill.io import storage

_TEMP = re.compile(r"^\.(?P<final>.+)\.tmp-[0-9a-f]{8}-[0-9a-f]{16}$")
ROWS = 14  # 4 shards of 4 rows: shard 0 holds the bad line, so it has an error file
BAD_LINE = "{not json"


@dataclass
class OutputFault:
    """Fails the ``nth`` write (from 1) to a file of the output whose name matches ``target``
    at step ``step`` ("open", "write" or "replace") with ``code``, then every later write into
    the output at that step (the disk stays full) until ``removed``."""

    out: Path
    target: str
    step: str
    code: int
    nth: int = 1
    tripped: bool = False
    removed: bool = False

    def fails(self, final: str) -> bool:
        if self.removed or not final.startswith(str(self.out)):
            return False
        if not self.tripped and re.search(self.target, final):
            self.nth -= 1
            self.tripped = self.nth == 0
        return self.tripped

    def error(self, path: str | None) -> OSError:
        return OSError(self.code, os.strerror(self.code), *(() if path is None else (path,)))


def _final_name(path: str) -> str:
    """The file a temporary file of ``OutputStore`` is written for (itself for other paths)."""
    folder, base = os.path.split(path)
    temp = _TEMP.match(base)
    return path if temp is None else os.path.join(folder, temp["final"])


def _inject(monkeypatch: pytest.MonkeyPatch, fault: OutputFault) -> None:
    """The output's writes fail as ``fault`` says: the store's own ``open`` of its temporary
    files and ``os.replace``, the calls a local write makes (storage.py's ``_local_file``)."""
    real_open, real_replace = builtins.open, os.replace

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        final = _final_name(str(file))
        if "x" not in mode or not fault.fails(final) or fault.step not in ("open", "write"):
            return real_open(file, mode, *args, **kwargs)
        if fault.step == "open":
            raise fault.error(str(file))
        f = real_open(file, mode, *args, **kwargs)
        write = f.write

        def write_half(data: Any) -> int:  # part of it, as a disk that fills meanwhile
            write(bytes(data)[: len(data) // 2])
            f.flush()
            raise fault.error(None)

        f.write = write_half
        return f

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if fault.step == "replace" and fault.fails(str(dst)):
            raise OSError(fault.code, os.strerror(fault.code), str(src), None, str(dst))
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(storage, "open", open_, raising=False)
    monkeypatch.setattr(storage.os, "replace", replace)


# (the file that fails, a pattern of its path; which of its writes, from 1)
POINTS = {
    "data file": ("shards/part-00002.parquet", r"shards/part-00002\.parquet$", 1),
    "error file": ("errors/part-00000.jsonl", r"errors/part-00000\.jsonl$", 1),
    "journal record": ("test.manifest.d/", r"test\.manifest\.d/[0-9]+\.json$", 2),
    "manifest saying complete": ("test.manifest.json", r"test\.manifest\.json$", 2),
    "report.html": ("report.html", r"report\.html$", 1),
    "report.json": ("report.json", r"report\.json$", 1),
}
# (step, errno, the exit code README gives it)
STEPS = {
    "read-only folder": ("open", errno.EACCES, 2),
    "read-only file system": ("open", errno.EROFS, 2),  # a read-only mount: not temporary
    "disk full at the rename": ("replace", errno.ENOSPC, 75),
    "disk error mid-write": ("write", errno.EIO, 75),
}


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("point", POINTS)
def test_a_failed_write_exits_as_documented_naming_the_file_and_the_rerun_completes(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    point: str,
    step: str,
) -> None:
    """An audit: a failed open or rename named the temporary file (".part-00002.parquet.tmp-
    9f86d081-…", just removed, which the user never made and cannot find), not the file
    being written."""
    name, target, nth = POINTS[point]
    how, code, exit_code = STEPS[step]
    rows = chat_rows(ROWS)
    lines = [json.dumps(r) for r in rows]
    lines.insert(1, BAD_LINE)
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, output={"format": "parquet", "rows_per_shard": 4})
    job = write_job(tmp_path, spec)
    fault = OutputFault(out, target, how, code, nth)
    _inject(monkeypatch, fault)

    assert run_cli(job, "--quiet", timeout_s=60) == exit_code
    assert fault.tripped
    said = [line for line in capsys.readouterr().err.splitlines() if "run-job:" in line]
    assert len(said) == 1, said
    assert str(out / name) in said[0] and os.strerror(code) in said[0], said[0]
    assert ".tmp-" not in said[0], said[0]
    assert "Traceback" not in said[0] and not any(r.exc_info for r in caplog.records)
    _check_output(out)

    fault.removed = True
    assert run_cli(job, "--quiet", timeout_s=60) == 0
    _check_output(out)
    ids = ds.dataset(out / "shards", format="parquet").to_table().column("id").to_pylist()
    assert sorted(ids) == [r["id"] for r in rows]  # each row once
    errors = (out / "errors" / "part-00000.jsonl").read_text().splitlines()
    assert len(errors) == 1 and "JSON" in json.loads(errors[0])["error"]


def _check_output(out: Path) -> None:
    """What the output holds now: every file a committed shard names reads back at its
    recorded size, no temporary file is left, and the shards read as one dataset."""
    for record in committed_shards(out).values():
        for key, size in (("data", "data_bytes"), ("error_file", "error_bytes")):
            if record[key] is None:
                continue
            path = out / record[key]
            assert path.stat().st_size == record[size], path
            if path.suffix == ".parquet":
                pq.read_table(path)
            else:
                [json.loads(line) for line in path.read_text().splitlines()]
    left = [str(p.relative_to(out)) for p in out.rglob("*") if _TEMP.match(p.name)]
    assert not left, f"temporary files left: {left}"
    if (out / "shards").exists():
        ds.dataset(out / "shards", format="parquet").to_table()


def test_a_run_that_committed_nothing_does_not_say_its_shards_are_kept(
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An audit: the first shard's write failed (a read-only folder), nothing was committed,
    and run-job still ended "committed shards are kept; rerun the same command to resume".
    It now says nothing was committed; with rows committed it says how many are kept."""
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(ROWS))
    out = tmp_path / "out"
    job = write_job(tmp_path, job_dict(tiny_model, src, out))
    fault = OutputFault(out, r"shards/part-\d+\.jsonl$", "open", errno.EACCES)
    _inject(monkeypatch, fault)
    assert run_cli(job, "--quiet", timeout_s=60) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert not committed_shards(out)
    assert "nothing was committed yet" in said and "are kept" not in said, said

    fault.removed, fault.tripped, fault.nth = False, False, 3  # two shards commit
    assert run_cli(job, "--quiet", timeout_s=60) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    kept = sum(r["ok"] + r["errors"] for r in committed_shards(out).values())
    assert kept > 0 and f"the {kept} committed rows are kept; rerun" in said, said


@pytest.mark.parametrize(
    ("folder", "rows"),
    [("shards", ROWS), ("errors", ROWS), ("shards", 0)],
    ids=["shards", "errors", "shards-of-no-input"],
)
def test_a_file_where_an_output_folder_goes_exits_2_naming_it(
    tiny_model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    folder: str,
    rows: int,
) -> None:
    """An audit: a file at out/shards (or out/errors) made os.makedirs raise FileExistsError,
    a "storage error" exiting 75 that cron and Airflow retry, while every rerun met the
    same file. It is a path to fix (exit 2), named; once it is moved, a rerun completes.
    (No input: the folder readers open is made at the end, the same way.)"""
    lines = [json.dumps(r) for r in chat_rows(rows)]
    src = write_jsonl(tmp_path / "in.jsonl", [BAD_LINE, *lines] if rows else [])
    out = tmp_path / "out"
    job = write_job(tmp_path, job_dict(tiny_model, src, out))
    out.mkdir()
    (out / folder).write_text("")
    assert run_cli(job, "--quiet", timeout_s=60) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert "NotADirectoryError" in said and str(out / folder) in said, said
    assert "rerunning as it is does not help" in said, said

    (out / folder).unlink()
    assert run_cli(job, "--quiet", timeout_s=60) == 0
    assert sum(r["ok"] + r["errors"] for r in committed_shards(out).values()) == (
        rows + 1 if rows else 0
    )
