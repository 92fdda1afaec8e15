"""What the Ray failure modules (test_ray_failures.py and test_ray_poison_rows.py, one module
split in two so that two pytest-xdist workers run them at once) share: their job settings,
running a job through the CLI, and reading its output by row id. Each module runs on the
``poisoned_ray`` fixture (tests/jobs/conftest.py): a local Ray of its own whose workers run
``ray_poison.install``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.jobs.job_helpers import read_jsonl_dir
from tokenmill.jobs.cli import main as cli_main

SMALL = {"engine": {"max_num_seqs": 2}, "sampling": {"max_tokens": 16}}
RAY = {"executor": "ray", "replicas": 2, "ray_address": None}


def run_cli(spec: dict[str, Any], folder: Path) -> int:
    """Run ``spec`` as ``run-job job.yaml --quiet`` (the job file written in ``folder``);
    return the exit code."""
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    return cli_main([str(job), "--quiet"])


def rows_by_id(out: Path, kind: str) -> dict[str, dict[str, Any]]:
    """The rows of ``out/kind`` (``shards`` or ``errors``) by id, checking none was written
    twice."""
    rows = read_jsonl_dir(out / kind)
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows), f"a row was written twice in {kind}"
    return by_id
