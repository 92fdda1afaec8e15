"""counted: a count and its noun, singular for one."""

from __future__ import annotations

from tokenmill.jobs.counted import counted


def test_one_is_singular_every_other_count_plural() -> None:
    assert counted(1, "file") == "1 file"
    assert counted(0, "file") == "0 files"
    assert counted(1204, "shard file") == "1,204 shard files"
    assert counted(2, "replica", "replicas") == "2 replicas"
