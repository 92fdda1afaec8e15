"""Building small jobs on the tiny random model for the job-runner tests."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import fsspec
import pytest
import yaml


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def chat_rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [
        {
            "id": f"r{i:04d}",
            "topic": f"t{i % 3}",
            "messages": [{"role": "user", "content": f"question number {i}: what is {i} + {i}?"}],
        }
        for i in range(start, start + n)
    ]


CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
# The engine of the OpenAI Batch job tests' reference LLM (the job_dict engine, as kwargs)
TINY_ENGINE = {"device": "cpu", "max_num_seqs": 8, "kv_cache_memory": 16 << 20}


def batch_line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI Batch input line."""
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def batch_job(
    model: Path, lines: list[dict[str, Any]], folder: Path, fmt: str = "openai-batch"
) -> dict[str, Any]:
    """A job over ``lines`` (OpenAI Batch input) written to ``folder``/out in ``fmt``."""
    src = write_jsonl(folder / "batch.jsonl", lines)
    spec = job_dict(model, src, folder / "out", output={"format": fmt})
    spec["input"] = {"path": str(src)}
    return spec


def job_dict(
    model: Path, input_path: Path | str, out_path: Path | str, name: str = "test", **sections: Any
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "model": {"source": str(model)},
        "input": {
            "path": str(input_path),
            "messages_column": "messages",
            "prompt_column": None,
            "passthrough_columns": ["topic"],
        },
        "sampling": {"max_tokens": 8, "temperature": 0.0},
        "output": {"path": str(out_path), "format": "jsonl", "rows_per_shard": 4},
        "engine": {"device": "cpu", "max_num_seqs": 8, "kv_cache_memory": 16 << 20},
    }
    for section, values in sections.items():
        spec.setdefault(section, {}).update(values)
    return spec


def write_job(folder: Path, spec: dict[str, Any]) -> Path:
    """Write ``spec`` (a job_dict) as ``folder/job.yaml``, the file a user hands ``run-job``;
    return its path. A job file written there before is replaced."""
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run_cli(job: Path | str, *args: str, timeout_s: float | None = None) -> int:
    """``run-job job *args`` in this process (tokenmill.jobs.cli.main, the command's own entry
    point, its messages on this process's stdout and stderr); return its exit code.

    With ``timeout_s`` the command runs in a thread joined for that long, so a run that hangs
    fails the test (an AssertionError naming the command) instead of blocking the suite; the
    thread is a daemon, left behind. An exception the command raises is raised here."""
    from tokenmill.jobs.cli import main as cli_main

    argv = [str(job), *args]
    if timeout_s is None:
        return cli_main(argv)
    ended: list[int | BaseException] = []

    def run() -> None:
        try:
            ended.append(cli_main(argv))
        except BaseException as e:  # raised again in the test's thread, below
            ended.append(e)

    thread = threading.Thread(target=run, name="run-job", daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"run-job {' '.join(argv)} did not end within {timeout_s} s"
    if isinstance(ended[0], BaseException):
        raise ended[0]
    return ended[0]


def read_jsonl_dir(folder: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(folder.glob("*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return rows


def reference_run(
    model: Path, folder: Path, rows: int, **sections: Any
) -> tuple[Path, dict[str, str]]:
    """An uninterrupted local run of ``rows`` chat rows: (input file, {id: text})."""
    from tokenmill import run_job

    src = write_jsonl(folder / "in.jsonl", chat_rows(rows))
    report = run_job(job_dict(model, src, folder / "out", **sections), show_progress=False)
    assert report.status == "complete" and report.rows_ok == rows
    return src, {r["id"]: r["text"] for r in read_jsonl_dir(folder / "out" / "shards")}


def committed_shards(out: Path | str, job: str = "test", fs: Any = None) -> dict[str, Any]:
    """The shards ``job``'s manifest names right now (its file and its journal, see
    tokenmill/jobs/manifest.py), read straight from the store while a run may be writing:
    ``out`` a local folder, or with ``fs`` (an fsspec filesystem) the output's path in it."""
    fs = fs or fsspec.filesystem("file")
    root = str(out).rstrip("/")
    try:
        shards = json.loads(fs.cat_file(f"{root}/{job}.manifest.json"))["shards"]
    except (FileNotFoundError, ValueError, KeyError):
        return {}
    journal = f"{root}/{job}.manifest.d"
    fs.invalidate_cache()
    for name in fs.find(journal) if fs.exists(journal) else []:
        try:
            shards[str(int(name.rsplit("/", 1)[1].removesuffix(".json")))] = json.loads(
                fs.cat_file(name)
            )
        except (FileNotFoundError, ValueError):  # folded into the file since the listing
            continue
    return shards


def count_rows_read(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """{row_index: times read}: from now on (until ``monkeypatch`` is undone), each InputRow
    that ``iter_input_rows`` makes of an input record, whoever reads (a sample, the run's
    feed, a dry run), is counted by its row index."""
    from tokenmill.io.readers import input_rows

    made: Counter[int] = Counter()
    make = input_rows._RowMaker.row

    def counted(self: Any, record: Any, row_index: int, ids: Any) -> Any:
        made[row_index] += 1
        return make(self, record, row_index, ids)

    monkeypatch.setattr(input_rows._RowMaker, "row", counted)
    return made
