"""Chunks of rows sent to Ray replicas, and what becomes of a chunk whose replica failed.

A replica fails as a whole (its process dies, or its engine raises in the middle of a batch):
every chunk it was running is lost, and nothing says which row did it. So a lost chunk is
a *suspect* and runs again **alone** on a replica (nothing else in flight there); a failure
while alone is then the chunk's own, and the chunk is bisected until the row is found:

    [a b c d] with 2 others ─ replica dies ─► suspect [a b c d], alone ─ dies ─► split
        [a b] alone ─► ok                         [c d] alone ─ dies ─► split
                                      [c] alone ─► ok      [d] alone ─ dies ─► ... poison

A one-row chunk is written as the row's error (the "poison row") once its lineage (the chunk
it came from and that chunk's own ancestors) has failed ``POISON_FAILURES`` times, at least
once with the row alone; before that it runs again (after a wait: below). Three failures, not
one, so that a replica killed by chance (preempted, OOM-killed for another reason) while it
ran an innocent row alone does not cost that row its result: a row is only skipped after it
failed every time it ran alone, and a chunk's innocent half simply succeeds. Suspects stay
bounded: each failure splits or retires a chunk, and finding the row in a chunk of n rows
takes about log2(n) + 2 replica failures (3 at least).

An outage is not a row: with every replica failing for a while (a 20 s engine failure, a
cluster hiccup), bisection would go on down to single rows and skip good ones. So a one-row
chunk that fails alone is *parked* (``Parked``), not run (during an outage it would only
fail again), and its failure counts only if it was the one failure between two finishes
(``Verdict``): a chunk finished before it with no failure since, and one finishes after it
with none between. An outage fails every replica whatever it runs, so its failures come in
a row and none of them counts; evidence from before the failure alone was not enough (an
outage that began after the last finish counted against the rows it failed: the good
neighbour of a poison row, its lineage's failures the bisection's, became an error row at
its first failure alone). A chunk finishing releases one parked row, so that in a job's
tail parked rows run one at a time: two poison rows released together fail together,
neither failure counts, and the probe after them released them together again, forever.
Halving a chunk of several rows goes on as before: it loses nothing.

    p fails alone ─ finish ─► counts        p fails alone ─ q fails ─► neither counts

When nothing but parked rows is left (a small job, or its tail), no row's chunk can finish
to vouch for the cluster, so the executor makes the evidence: a *probe* (``probe``), one
known-good request (a two-letter prompt, ``max_tokens`` 1), runs alone on a replica. If it
finishes, the cluster works: the failure before it counts if it was the only one, and a
parked row runs again. A poison row that is the last work left is still isolated (each of
its counted failures costs one probe more). If the probe fails too, that is the outage's
failure, not a row's: nothing is counted against a row, and another probe follows (on the
new replica) until one finishes or the breaker below ends the job.

Replica failures in a row with nothing finishing between them (``give_up_after``: the job's
``execution.replica_failures_in_a_row``, by default max(16, 4 x replicas)) end the job
(``ReplicasFailingError``, exit 1, the rows in flight unwritten: a rerun resumes), as the
local executor ends on its engine's first error: with every replica failing whatever it ran,
a job of 12 rows "completed" with 12 error rows (an audit). Isolating a poison row never
takes that many: a bisection's innocent half, or a probe, finishes every other failure, and
a row's counted failures alone each have a finish on either side. An outage of more
failures than the breaker's ends the job the same way, a shorter one costs no row: the
work left, or a probe, shows when the cluster works again. Not told apart: a replica killed
by chance (or an "outage" of one failure) while a row ran alone, with nothing else failing,
counts against that row; it is skipped only when that happens at each of its lineage's
counted failures.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.requests import error_result

__all__ = [
    "POISON_FAILURES",
    "Chunk",
    "ChunkRecovery",
    "Parked",
    "ReplicasFailingError",
    "Verdict",
]

POISON_FAILURES = 3  # failures of a row's lineage, the last one alone, before it is skipped
PROBE_PROMPT = "hi"  # a raw prompt: no chat template needed, any model can run it
# The probe's own sampling over the job's: one token, and none of the job's settings that
# could refuse or slow a request (structured output, several completions, a long minimum).
PROBE_SAMPLING = {
    "max_tokens": 1,
    "min_tokens": 0,
    "n": 1,
    "best_of": None,
    "structured_output": None,
}


class ReplicasFailingError(RuntimeError):
    """Replicas kept failing with no chunk finishing between the failures."""


@dataclass(frozen=True)
class Chunk:
    """Rows that travel to one replica together and come back together. ``failures``: how
    often this chunk or the chunks it was split from were lost with a failed replica (a
    one-row chunk's failure alone once its verdict counts it: ``Verdict``). ``probe``: the
    one known-good request of a probe (``ChunkRecovery.probe``), no job row."""

    id: int
    rows: tuple[InputRow, ...]
    failures: int = 0
    probe: bool = False

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class Parked:
    """A one-row chunk that failed alone: it waits (not run, its failure not yet counted)
    until a chunk finishes (a probe's, when nothing else is left)."""

    chunk: Chunk


@dataclass(frozen=True)
class Verdict:
    """A chunk finished right after a parked row's failure alone, the one failure since the
    previous finish: the failure was the row's. ``parked``: the chunk as parked;
    ``outcome``: it with that failure counted, to park again (its turn to run comes), or
    the row's error result once its lineage has failed ``poison_failures`` times."""

    parked: Chunk
    outcome: Chunk | ResultRow


class ChunkRecovery:
    """Numbers chunks, and decides what happens to the chunks of a failed replica: run
    again as suspects (whole, or split in halves), or parked, a row that failed alone, until
    a chunk finishing gives the verdict on its failure (``done``): to run again, or, for a
    poison row, its error result.
    ``model`` names the model in error results (the spec's model.source)."""

    def __init__(
        self, model: str, poison_failures: int = POISON_FAILURES, give_up_after: int = 16
    ) -> None:
        """``give_up_after``: replica failures in a row, nothing finishing between them,
        that end the job (the job's execution.replica_failures_in_a_row)."""
        if poison_failures < 1:
            raise ValueError(f"poison_failures must be >= 1, got {poison_failures}")
        if give_up_after < 1:
            raise ValueError(f"give_up_after must be >= 1, got {give_up_after}")
        self.model = model
        self.poison_failures = poison_failures
        self.give_up_after = give_up_after
        self._ids = itertools.count()
        self._probe_ids = itertools.count(-1, -1)  # probes' row indexes: no job row's
        self.failures_since_done = 0  # replica failures since a chunk last finished
        # the parked row whose failure is the only one since a chunk last finished, and why
        self._accused: tuple[Chunk, str] | None = None

    def chunk(self, rows: list[InputRow] | tuple[InputRow, ...], failures: int = 0) -> Chunk:
        """A new chunk of ``rows`` (at least one), with the next id."""
        if not rows:
            raise ValueError("a chunk needs at least one row")
        return Chunk(next(self._ids), tuple(rows), failures)

    def done(self) -> Verdict | None:
        """A chunk finished (its replica answered for all its rows): the cluster works, so a
        parked row may run again. Returns the verdict on the row whose failure alone was the
        only failure since the previous finish, if any: that failure was the row's."""
        self.failures_since_done = 0
        accused, self._accused = self._accused, None
        if accused is None:
            return None
        chunk, reason = accused
        return Verdict(chunk, self._counted(chunk, reason))

    def probe(self) -> Chunk:
        """A chunk of one known-good request (no job row: a negative row index, which no
        result is written for), to run alone when only parked rows are left: its finishing
        is the evidence that releases them (``done``), its failure is the outage's. Neither
        waiting on (a poison row that is the last work would never be isolated: the breaker
        ended the job) nor releasing them unproven (an outage in the tail wrote good rows
        as error rows) tells an outage from a poison row; a probe does."""
        index = next(self._probe_ids)
        row = InputRow(
            index, f"probe{index}", "probe", prompt=PROBE_PROMPT, sampling=dict(PROBE_SAMPLING)
        )
        return Chunk(next(self._ids), (row,), probe=True)

    def failed(self, reason: str) -> None:
        """A replica failed (before ``lost`` for each chunk it held).
        Raises ReplicasFailingError once replicas have failed ``give_up_after`` times in a
        row with nothing finishing."""
        self.failures_since_done += 1
        self._accused = None  # a failure besides it: an outage may have failed them both
        if self.failures_since_done >= self.give_up_after:
            raise ReplicasFailingError(
                f"Ray replicas failed {self.failures_since_done} times in a row with no chunk "
                f"of rows finishing between the failures (the last: {reason}): the engine or "
                "the cluster fails, not a row. The rows in flight were not written; fix the "
                "cause and rerun the same command to resume (a cluster known to be flaky: "
                "raise execution.replica_failures_in_a_row)"
            )

    def lost(self, chunk: Chunk, alone: bool, reason: str) -> list[Chunk] | Parked:
        """``chunk`` was running when its replica failed because of ``reason``; ``alone``:
        it was the only chunk there. Returns the suspects to run next (each alone; none for
        a probe: the executor sends another while rows are parked), or a one-row chunk
        parked (``done`` gives the verdict on its failure)."""
        if chunk.probe:  # a known-good request failed: the cluster fails, not a row
            return []
        failures = chunk.failures + 1
        if not alone:  # any of the replica's chunks may have done it: run this one alone
            return [self.chunk(chunk.rows, failures)]
        if len(chunk) > 1:
            half = len(chunk) // 2
            return [
                self.chunk(chunk.rows[:half], failures),
                self.chunk(chunk.rows[half:], failures),
            ]
        if self.failures_since_done == 1:  # no other failure since a chunk last finished
            self._accused = (chunk, reason)
        return Parked(chunk)

    def _counted(self, chunk: Chunk, reason: str) -> Chunk | ResultRow:
        """``chunk``, a one-row chunk, with its failure alone counted: itself to run again, or
        its row's error result once its lineage has failed ``poison_failures`` times."""
        failures = chunk.failures + 1
        if failures < self.poison_failures:
            return replace(chunk, failures=failures)
        row = chunk.rows[0]
        return error_result(
            row,
            f"this row failed every engine replica that ran it ({failures} replica failures, "
            f"the last with the row running alone): {reason}. It was skipped so that the job "
            "could finish; run it alone (e.g. with executor: local) to reproduce the failure",
            self.model,
        )
