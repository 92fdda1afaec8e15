"""ChunkRecovery without Ray: what happens to the chunks of a failed replica. A chunk lost
with others runs again whole, a chunk lost alone is halved, a row is skipped only after its
lineage failed POISON_FAILURES times, and a poison row is found in about log2(n) + 2
failures while the rows beside it all run again."""

from __future__ import annotations

import pytest

from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.ray_chunks import POISON_FAILURES, Chunk, ChunkRecovery


def _rows(n: int) -> list[InputRow]:
    return [InputRow(i, f"r{i}", f"in.jsonl:{i + 1}", prompt=f"p{i}") for i in range(n)]


def test_a_chunk_lost_with_others_runs_again_whole_then_is_halved_alone() -> None:
    recovery = ChunkRecovery("m")
    chunk = recovery.chunk(_rows(5))

    again = recovery.lost(chunk, alone=False, reason="died")
    assert isinstance(again, list) and len(again) == 1
    assert again[0].rows == chunk.rows and again[0].failures == 1 and again[0].id != chunk.id

    halves = recovery.lost(again[0], alone=True, reason="died")
    assert isinstance(halves, list)
    assert [[r.row_index for r in h.rows] for h in halves] == [[0, 1], [2, 3, 4]]
    assert [h.failures for h in halves] == [2, 2]


def test_a_row_is_skipped_only_after_its_lineage_failed_poison_failures_times() -> None:
    recovery = ChunkRecovery("model-x")
    row = _rows(1)[0]
    chunk: Chunk | ResultRow = recovery.chunk([row])
    for _ in range(POISON_FAILURES - 1):  # a replica killed by chance: the row runs again
        assert isinstance(chunk, Chunk)
        outcome = recovery.lost(chunk, alone=True, reason="the replica's engine raised X")
        assert isinstance(outcome, list) and len(outcome) == 1
        chunk = outcome[0]
    assert isinstance(chunk, Chunk)
    skipped = recovery.lost(chunk, alone=True, reason="the replica's engine raised X")

    assert isinstance(skipped, ResultRow) and not skipped.ok
    assert (skipped.row_id, skipped.row_index, skipped.model) == ("r0", 0, "model-x")
    assert skipped.error is not None and skipped.error.startswith("in.jsonl:1: ")
    assert "failed every engine replica" in skipped.error and "raised X" in skipped.error


def test_bisecting_finds_the_poison_row_and_runs_every_other_row_again() -> None:
    """Replay: a replica fails whenever the poison row is among its chunks."""
    recovery = ChunkRecovery("m")
    poison = 37
    suspects = [recovery.chunk(_rows(64))]
    finished: list[int] = []
    skipped: list[ResultRow] = []
    failures = 1  # the first failure, with other chunks on the replica
    outcome = recovery.lost(suspects.pop(), alone=False, reason="died")
    assert isinstance(outcome, list)
    suspects.extend(outcome)
    while suspects:  # each suspect runs alone
        chunk = suspects.pop()
        if all(r.row_index != poison for r in chunk.rows):
            finished.extend(r.row_index for r in chunk.rows)
            continue
        failures += 1
        outcome = recovery.lost(chunk, alone=True, reason="died")
        if isinstance(outcome, ResultRow):
            skipped.append(outcome)
        else:
            suspects.extend(outcome)

    assert [r.row_index for r in skipped] == [poison]
    assert sorted(finished) == [i for i in range(64) if i != poison]
    # one failure with others, six halvings (64 -> 1), then the row alone: its lineage has
    # failed POISON_FAILURES times already, so its first failure alone skips it
    assert POISON_FAILURES <= 7 and failures == 1 + 6 + 1


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="poison_failures"):
        ChunkRecovery("m", poison_failures=0)
    with pytest.raises(ValueError, match="at least one row"):
        ChunkRecovery("m").chunk([])


def test_a_replica_that_dies_while_starting_is_a_lost_replica_of_the_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica whose process died while it loaded its model was restarted without a word
    to the report: `replica_failures.replicas` counted only replicas that died holding
    rows. Now the pool hands the executor the loss (no rows in it), which counts it."""
    ray = pytest.importorskip("ray")
    from tokenmill.jobs.ray_executor import RayExecutor, _Run
    from tokenmill.jobs.ray_replica_failures import ReplicaFailures
    from tokenmill.jobs.ray_replica_pool import ReplicaLost, ReplicaPool, ReplicaSlot

    pool = object.__new__(ReplicaPool)  # no actors: the start and kill are Ray's
    pool._model, pool.slots = "m", [ReplicaSlot(0), ReplicaSlot(1)]
    monkeypatch.setattr(pool, "_start", lambda slot: None)
    monkeypatch.setattr(pool, "_kill", lambda slot: None)
    lost = pool._start_failed(pool.slots[0], ray.exceptions.RayActorError())
    assert isinstance(lost, ReplicaLost) and lost.chunks == [] and not lost.alone
    assert pool.slots[0].restarts == 1 and "while starting" in lost.reason

    executor = object.__new__(RayExecutor)
    executor.failures, executor._recovery = ReplicaFailures(), ChunkRecovery("m")
    executor._router = None
    executor.chunk_rows = 4
    run = _Run(pool, source=None)
    assert executor._lost(lost, run) == []
    assert (executor.failures.replicas, executor.failures.rows_rerun) == (1, 0)


def test_replicas_failing_in_a_row_with_nothing_finishing_end_the_job() -> None:
    """An audit: with every replica's engine failing, a job of 12 rows "completed", exit 0,
    every row an error; the local executor ends on its engine's first error (exit 1)."""
    from tokenmill.jobs.ray_chunks import ReplicasFailingError

    recovery = ChunkRecovery("m", give_up_after=3)
    recovery.failed("x")
    recovery.done()  # a chunk finished between: the count starts again
    recovery.failed("x")
    recovery.failed("x")
    with pytest.raises(ReplicasFailingError, match=r"failed 3 times in a row .* \(the last: y\)"):
        recovery.failed("y")
