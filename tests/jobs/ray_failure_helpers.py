"""What the Ray failure modules (test_ray_failures.py and test_ray_poison_rows.py, one module
split in two so that two pytest-xdist workers run them at once) share: their job settings and
reading a job's output by row id (they run jobs through job_helpers.run_cli). Each module
runs on the ``poisoned_ray`` fixture (tests/jobs/conftest.py): a local Ray of its own whose
workers run ``ray_poison.install``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.jobs.job_helpers import read_jsonl_dir

SMALL = {"engine": {"max_num_seqs": 2}, "sampling": {"max_tokens": 16}}
RAY = {"executor": "ray", "replicas": 2, "ray_address": None}


def rows_by_id(out: Path, kind: str) -> dict[str, dict[str, Any]]:
    """The rows of ``out/kind`` (``shards`` or ``errors``) by id, checking none was written
    twice."""
    rows = read_jsonl_dir(out / kind)
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows), f"a row was written twice in {kind}"
    return by_id
