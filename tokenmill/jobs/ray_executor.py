"""The Ray executor: the driver feeds chunks of rows to engine replicas (plain Ray actors).

    driver (runner thread)                                   Ray cluster
    rows ─► route (a replica per row) ─► chunks ─► run() x <= 4 per replica ─► EngineReplica
      ▲                                                                   engine never drains
      └── yield ◄── results per chunk ◄── ray.wait (ReplicaPool.poll) ◄──┘
                    lost chunks ─► suspects, each run alone, bisected ─► a poison row's error

The runner's feed stays on the driver: it owns the global row order, duplicate-id detection
across files, skipping committed shards and the shard tracker; ``process`` pulls the rows
(without waiting while replicas are busy), gives each row a replica (``_route``: the one
place that decides; ``planner.routing: prefix``, the default, by the row's leading prompt
text through a PrefixRouter, so that rows sharing a system prompt or document share one
replica's prefix cache, with each replica's rows in flight within 25% of the mean;
``balance``, the replica with the fewest whole chunks queued and running, so that
consecutive rows fill a chunk before the next replica gets any), and sends each replica
chunks of
``max_num_seqs`` rows, at most 4 in flight per replica. A replica feeds its engine from all
the chunks it holds (ray_replica.py), so its batch stays full across chunk boundaries, and
memory stays bounded however large the input: the driver holds at most
``4 * replicas * max_num_seqs`` rows that have no result yet.

Failures (ray_replica_pool.py, ray_chunks.py): a replica whose process dies, or whose engine
raises, loses only the chunks it held; a new replica takes its place (the model reloads) and
the lost chunks run again, each alone on a replica, so that a chunk that fails again is
known to be the culprit and is bisected down to the row that does it; that row is written
to the error file with what happened, and the job goes on. A row that fails alone is parked
(``_Run.parked``) until a chunk finishes, and its failure counts only if nothing else failed
between the finishes before and after it: an outage fails every replica, and is not the
row's fault. Each finish releases one parked row. With nothing else queued or in flight, a
probe (one known-good request) runs alone to show that the cluster works; its failure is
the outage's, never a row's, and leads to another probe, or to the breaker. A result arriving
for a row already answered is dropped, so every row is answered once. Commits stay on the
driver, through the runner's exactly-once writer.

Why plain actors and not Ray Data's map_batches: Ray Data retries an actor's lost blocks
by itself, forever (a poison row hangs the job) and fails the whole dataset when a batch
raises; it does not say which block ran where, so nothing could isolate a row. And a
map_batches call runs one block at a time, so the engine drained at every block's end.

Progress: each chunk's result carries its replica's running counts (EngineCounters, output
tokens included) and its per-step batch histogram (StepBatches); the driver's live counts are
the replicas' sums as of their last chunks. A replica's start (process, imports, model) is
load time, not generation time until the first is up (``first_up_seconds``: the report's
generation time starts there, the slower replicas' loads overlapping the first's work);
``load_seconds`` is the slowest replica's first start.

``ray_address: null`` starts a local Ray (or reuses the one already initialised in this
process; ``RAY_ADDRESS`` in the environment is honoured as Ray always does); an address joins
that cluster. Each replica loads the model inside its actor from ``model.source``: on a
cluster every node that may host a replica needs tokenmill installed and the model files at
that path (or the alias resolvable there).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import ray

from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.io.url_secrets import hide_url_secrets
from tokenmill.jobs.counted import counted
from tokenmill.jobs.engine_counters import EngineCounters
from tokenmill.jobs.progress import LiveCounts
from tokenmill.jobs.ray_chunks import Chunk, ChunkRecovery, Parked, Verdict
from tokenmill.jobs.ray_cluster_watch import GcsWatch, wait_for_head
from tokenmill.jobs.ray_replica_failures import ReplicaFailures
from tokenmill.jobs.ray_replica_pool import (
    ChunkDone,
    PoolEvent,
    ReplicaLost,
    ReplicaPool,
    ReplicaSlot,
    ReplicaUp,
)
from tokenmill.jobs.ready_rows import ReadyRow
from tokenmill.jobs.row_source import FeedItem, RowSource
from tokenmill.jobs.spec import JobSpec
from tokenmill.jobs.step_batches import StepBatches
from tokenmill.jobs.stop_signals import stop_handlers_kept, stop_signals_held
from tokenmill.scheduling import PrefixRouter, row_prefix_key

__all__ = ["CHUNKS_PER_REPLICA", "RayExecutor", "replica_resources"]

log = logging.getLogger("tokenmill.jobs")

# Chunks in flight per replica: its engine holds about two (2 * max_num_seqs rows), the
# others wait on the actor, so a finished chunk's successor arrives before the engine runs dry.
CHUNKS_PER_REPLICA = 4
_POLL_S = 0.1  # how often a wait for results re-checks ``cancel`` and calls ``on_step``
# Seconds a replica may take to start, and times the slowest first start of those up, before
# the rows waiting on it go to replicas that are up.
START_GRACE_S = 60.0
START_GRACE_FACTOR = 2.0


def replica_resources(spec: JobSpec, cluster_gpus: float) -> dict[str, float]:
    """Ray resources of one engine replica: ``tensor_parallel * pipeline_parallel`` GPUs when
    the engine runs on CUDA (``device: auto`` means: when the cluster has GPUs), else 1 CPU."""
    if replicas_on_gpu(spec, cluster_gpus):
        return {"num_gpus": spec.model.tensor_parallel * spec.model.pipeline_parallel}
    return {"num_cpus": 1}


def replicas_on_gpu(spec: JobSpec, cluster_gpus: float) -> bool:
    """Whether the replicas' engines run on CUDA: ``device: auto`` where the cluster has
    GPUs (``cluster_gpus``), or a cuda device named."""
    device = spec.engine.device
    return cluster_gpus > 0 if device == "auto" else device.startswith("cuda")


class RayExecutor:
    """``execution.replicas`` engine replicas as Ray actors; the interface of RowProcessor.
    ``expected_rows`` (the input's row count, if known) only sizes the chunks.

    ``process`` raises ReplicaStartError when a replica cannot load the model. ``close``
    kills the replicas, and shuts Ray down when this executor started it.
    """

    def __init__(self, spec: JobSpec, expected_rows: int | None = None) -> None:
        self.spec = spec
        self.replicas = spec.execution.replicas
        self.chunk_rows = spec.engine.max_num_seqs
        if expected_rows:  # at least 2 chunks per replica, or some replicas would idle
            self.chunk_rows = min(self.chunk_rows, math.ceil(expected_rows / (2 * self.replicas)))
        self.max_in_flight = CHUNKS_PER_REPLICA * self.replicas * self.chunk_rows
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            wait_for_head(spec.execution.ray_address)
            with stop_handlers_kept():
                ray.init(address=spec.execution.ray_address, include_dashboard=False)
        elif spec.execution.ray_address is not None:
            log.info(
                "Ray is already initialised in this process; using it, not execution."
                "ray_address=%s",
                spec.execution.ray_address,
            )
        # Ray's C++ core ends a driver that cannot reach its head for 60 s, with no
        # Python exception: the watch makes the run fail (and write its report) first.
        self._watch = GcsWatch(ray.get_runtime_context().gcs_address)
        total = ray.cluster_resources()
        self._resources = replica_resources(spec, total.get("GPU", 0))
        # what model.dtype auto resolves to on them (replica_dtype.py)
        self.on_gpu = replicas_on_gpu(spec, total.get("GPU", 0))
        self._room_for_all = True  # the cluster can run every replica at once
        for key, amount in self._resources.items():
            name = {"num_gpus": "GPU", "num_cpus": "CPU"}[key]
            if amount * self.replicas > total.get(name, 0):
                self._room_for_all = False
                log.warning(
                    "execution.replicas=%d needs %g %s in all; the Ray cluster has %g now: "
                    "replicas wait for resources (fewer replicas, or a larger cluster)",
                    self.replicas,
                    amount * self.replicas,
                    name,
                    total.get(name, 0),
                )
        breaker = spec.execution.replica_failures_in_a_row or max(16, 4 * self.replicas)
        self._recovery = ChunkRecovery(spec.model.source, give_up_after=breaker)
        self._pool: ReplicaPool | None = None
        self._started = 0.0
        self._stats: dict[str, EngineCounters] = {}  # replica process -> its last counts
        self._batches: dict[str, StepBatches] = {}
        self._load_seconds: dict[int, float] = {}  # replica -> seconds to its first start
        # the replicas' engines' context: the same on each (the job's settings', or the
        # replica refuses to start: local_executor._check_context), known once one is up
        self._max_model_len: int | None = None
        self._rows_in_flight = 0
        self._by_prefix = spec.planner.settings().by_prefix and self.replicas > 1
        self._router: PrefixRouter | None = None  # one per process() call, for prefix
        self._replica_of: dict[int, int] = {}  # row index -> the replica it was routed to
        self.failures = ReplicaFailures()  # this executor's, over all process() calls

    def start(self) -> ReplicaPool:
        """Start the replicas (once; ``process`` does it): they load their models while the
        driver goes on."""
        if self._pool is None:
            source = self.spec.model.source
            spec_dict = self.spec.to_dict()
            # A replica reads no input and writes no output: no store's credentials in its
            # actor's arguments, which Ray keeps in the cluster's state (an audit), nor an
            # HTTP(S) input's password or presigned signature.
            for section in ("input", "output"):
                spec_dict[section]["storage_options"] = {}
                spec_dict[section]["path"] = hide_url_secrets(spec_dict[section]["path"])
            spec_dict["execution"]["ray_address"] = None
            if os.path.exists(source):  # a relative path means the driver's directory
                spec_dict["model"]["source"] = os.path.abspath(source)
            self._started = time.monotonic()
            self._pool = ReplicaPool(
                spec_dict,
                source,
                self.replicas,
                self._resources,
                CHUNKS_PER_REPLICA,
                self.spec.execution.stall_timeout_s,
                cluster_answers=self._watch.answers,
            )
        return self._pool

    def process(
        self,
        rows: RowSource | Iterable[InputRow],
        cancel: threading.Event | None = None,
        on_step: Callable[[], None] | None = None,
    ) -> Iterator[ResultRow]:
        """Run good rows through the replicas; yields one ResultRow per row, in any order.
        On ``cancel`` it stops pulling rows and returns; in-flight rows yield nothing.
        ``on_step`` is called at every poll for results (at least every 0.1 s)."""
        cancel = cancel or threading.Event()
        run = _Run(self.start(), rows if isinstance(rows, RowSource) else _RowIter(rows))
        self._router = PrefixRouter(self.replicas) if self._by_prefix else None
        self._replica_of = {}
        try:
            while not cancel.is_set():
                results = run.pull(self.max_in_flight, self._route)
                self._probe_for_parked(run)
                self._send(run)
                if run.finished:
                    yield from results
                    return
                for event in run.pool.poll(_POLL_S):
                    results += self._handle(event, run)
                self._watch.check()  # (the events of a cluster still up are handled first)
                self._rows_in_flight = len(run.in_flight)
                if on_step is not None:
                    on_step()
                for result in results:
                    replica = self._replica_of.pop(result.row_index, None)
                    if replica is not None and self._router is not None:
                        self._router.release(replica)
                    yield result
                    if cancel.is_set():
                        return
        finally:
            self._rows_in_flight = 0

    def _route(self, row: InputRow, run: _Run) -> ReplicaSlot:
        """The replica that runs ``row``: the one place rows are assigned to replicas, among
        those that are up (all of them while none is). ``planner.routing: prefix``: rows
        whose prompts (or conversations) start alike go to one replica, whose prefix cache
        then serves their shared blocks; the router keeps each replica's rows in flight
        (routed, no result yet) within its bound of the mean. ``balance``: the replica with
        the fewest whole chunks' worth of rows running and pending (the lowest index on a
        tie), so consecutive rows fill one chunk before the next replica gets any."""
        up = [s for s in run.pool.slots if s.up] or run.pool.slots
        if self._router is None:
            return min(
                up,
                key=lambda s: (
                    (s.rows_running + len(run.pending[s.index])) // self.chunk_rows,
                    s.index,
                ),
            )
        previous = self._replica_of.get(row.row_index)
        if previous is not None:  # rerouted from a lost replica: it no longer waits there
            self._router.release(previous)
        replica = self._router.assign(row_prefix_key(row), available=[s.index for s in up])
        self._replica_of[row.row_index] = replica
        return run.pool.slots[replica]

    def _send(self, run: _Run) -> None:
        """Send chunks to the replicas that are up and have room. While suspects wait, one
        replica (the least busy) takes no new chunks, so that it soon runs one alone; any
        idle replica takes one."""
        self._reroute_from_down(run)
        up = [s for s in run.pool.slots if s.up and not s.isolated]
        quarantine = None
        if run.suspects and up:
            quarantine = min(up, key=lambda s: (len(s.running), s.index))
        for slot in up:
            if run.suspects and not slot.running:
                run.pool.submit(slot, run.suspects.popleft(), alone=True)
                continue
            if slot is quarantine:
                continue
            pending = run.pending[slot.index]
            while pending and len(slot.running) < CHUNKS_PER_REPLICA:
                # a partial chunk goes at once: the source has nothing more ready now
                rows, pending[:] = pending[: self.chunk_rows], pending[self.chunk_rows :]
                run.pool.submit(slot, self._recovery.chunk(rows))

    def _reroute_from_down(self, run: _Run) -> None:
        """Rows routed while no replica was up wait on every replica. On a cluster without
        room for them all, some may never start: once some are up, the rows waiting on one
        that is not go to those that are (they waited there forever before, the job hanging
        with its rows in flight). With room for all, a replica still loading its model
        keeps its rows (its prefix-cache affinity, and the parallelism it brings) until its
        start is overdue (``_start_overdue``): one whose start hangs (a load stuck on a
        network file system, a CUDA init that never returns) held them forever, the job
        at "152 of 160 rows done" until stopped (an audit)."""
        if not any(s.up for s in run.pool.slots):
            return
        for slot in run.pool.slots:
            if not slot.up and (not self._room_for_all or self._start_overdue(slot)):
                self._reroute_waiting(slot, run)

    def _start_overdue(self, slot: ReplicaSlot) -> bool:
        """Whether ``slot`` has been starting for longer than ``START_GRACE_S`` and
        ``START_GRACE_FACTOR`` times the slowest first start of the replicas that are up."""
        slowest = max(self._load_seconds.values(), default=0.0)
        return time.monotonic() - slot.started_at > max(START_GRACE_S, START_GRACE_FACTOR * slowest)

    def _reroute_waiting(self, slot: ReplicaSlot, run: _Run) -> None:
        """The rows waiting to be sent to ``slot`` go where ``_route`` now sends them."""
        waiting, run.pending[slot.index] = run.pending[slot.index], []
        for row in waiting:
            run.pending[self._route(row, run).index].append(row)

    def _handle(self, event: PoolEvent, run: _Run) -> list[ResultRow]:
        """Apply one pool event; the results it brings."""
        if isinstance(event, ReplicaUp):
            self._note_up(event)
            return []
        if isinstance(event, ChunkDone):
            key = event.slot.key
            self._stats[key] = event.result.counters
            self._batches[key] = event.result.batches
            poisoned = self._judge(self._recovery.done(), run)
            # the cluster works: a parked row runs again; one at a time, for parked poison
            # rows run together fail together, and neither failure would count
            if run.parked:
                run.suspects.append(run.parked.popleft())
            return run.answered(event.result.results + poisoned)
        self._lost(event, run)
        return []

    def _judge(self, verdict: Verdict | None, run: _Run) -> list[ResultRow]:
        """Apply the verdict on a parked row's failure (ray_chunks.py): the row waits its
        turn with the failure counted, or, a poison row, is skipped. Its error result, if
        any."""
        if verdict is None or verdict.parked not in run.parked:  # (an earlier process call's)
            return []
        run.parked.remove(verdict.parked)
        if isinstance(verdict.outcome, Chunk):
            run.parked.append(verdict.outcome)
            return []
        log.error("row %s skipped: %s", verdict.outcome.row_id, verdict.outcome.error)
        self.failures.rows_isolated += 1
        return [verdict.outcome]

    def _lost(self, event: ReplicaLost, run: _Run) -> None:
        """A replica failed: its chunks run again as suspects (a row that failed alone is
        parked), and the rows waiting for it go to the replicas still up."""
        rows = sum(len(c) for c in event.chunks if not c.probe)  # a probe runs no job row
        self.failures.replicas += 1
        log.warning(
            "Ray replica %d failed with %d rows in flight (%s); a new replica takes its place%s",
            event.slot.index,
            rows,
            event.reason,
            ", and its rows run again" if rows else "",
        )
        self._recovery.failed(event.reason)
        for chunk in event.chunks:
            outcome = self._recovery.lost(chunk, event.alone, event.reason)
            if isinstance(outcome, Parked):
                log.info(
                    "row %s waits to run again: it failed alone, and it counts only if a chunk "
                    "finishes next (else the cluster may be failing, not the row)",
                    outcome.chunk.rows[0].row_id,
                )
                run.parked.append(outcome.chunk)
                self.failures.rows_rerun += len(outcome.chunk)
            else:
                run.suspects.extend(outcome)
                self.failures.rows_rerun += sum(len(c) for c in outcome)
        self._reroute_waiting(event.slot, run)

    def _evidence_may_come(self, run: _Run) -> bool:
        """Whether rows are queued or running, or may still come from the source, so that
        a chunk may yet finish and show that the cluster works (parked rows do not run:
        they cannot). Call after the pool has dropped a failed replica's chunks."""
        return bool(
            run.suspects
            or any(run.pending)
            or any(slot.running for slot in run.pool.slots)
            or (not run.source.exhausted and len(run.in_flight) < self.max_in_flight)
        )

    def _probe_for_parked(self, run: _Run) -> None:
        """With only parked rows left, no chunk of theirs can finish to show that the cluster
        works: a probe runs alone instead (ray_chunks.py). Its finishing releases them, their
        next failure counting; its failure counts against no row, and another probe follows
        at the next call, one at a time (a probe queued or running is evidence that may
        come), until one finishes or the breaker ends the job."""
        if run.parked and not self._evidence_may_come(run):
            run.suspects.append(self._recovery.probe())
            self.failures.probes += 1
            log.info(
                "%s to run again, and nothing else is left to show that the cluster works: a "
                "probe (one short request) runs first",
                counted(len(run.parked), "row waits", "rows wait"),
            )

    def _note_up(self, event: ReplicaUp) -> None:
        slot, info = event.slot, event.info
        self._max_model_len = info.max_model_len
        if slot.restarts:
            log.info(
                "Ray replica %d restarted (pid %d, model loaded in %.1f s)",
                slot.index,
                info.pid,
                info.load_seconds,
            )
        elif slot.index not in self._load_seconds:
            self._load_seconds[slot.index] = time.monotonic() - self._started
            log.info(  # (by its index, as report.html's replica-<index>, not its place)
                "Ray replica %d up in %.1f s (model loaded in %.1f s; %d of %d up)",
                slot.index,
                self._load_seconds[slot.index],
                info.load_seconds,
                len(self._load_seconds),
                self.replicas,
            )

    @property
    def counters(self) -> EngineCounters:
        """The engines' counts (prefix cache, speculative drafts), summed over replicas."""
        return sum(self._stats.values(), EngineCounters())

    @property
    def step_batches(self) -> StepBatches:
        """Rows each replica's engine held at each step, summed over replicas."""
        return sum(self._batches.values(), StepBatches())

    @property
    def first_up_seconds(self) -> float:
        """The first replica's start (0 before one is up): from then a replica generates,
        while the slower ones still load, so the report's generation time starts there."""
        return min(self._load_seconds.values(), default=0.0)

    @property
    def load_seconds(self) -> float:
        """The slowest replica's start so far (process, imports and model; they start in
        parallel, inside ``process``)."""
        return max(self._load_seconds.values(), default=0.0)

    def live(self) -> LiveCounts:
        """The replicas' output tokens as of their last chunks, the rows sent and not answered,
        the replicas' start time inside ``process`` so far and their engines' context once
        one is up (for the progress line and its ETA)."""
        counters = self.counters
        return LiveCounts(
            counters.output_tokens,
            self._rows_in_flight,
            self.load_seconds,
            preemptions=counters.preemptions,
            max_model_len=self._max_model_len,
        )

    @property
    def counters_by_replica(self) -> dict[str, EngineCounters]:
        """Replica process (``replica-0``, ``replica-0.restart-1``, ...) -> its counts."""
        return dict(self._stats)

    def close(self) -> None:
        """Kill the replicas (their in-flight rows are dropped); shut Ray down if we started
        it. With the cluster lost, it makes no Ray call: each would wait on the head that
        is gone until Ray ends the process (60 s), taking the run's report with it."""
        self._watch.stop()
        if self._watch.lost:
            self._pool = None
            return
        if self._pool is not None and ray.is_initialized():
            self._pool.close()
        self._pool = None
        if self._owns_ray and ray.is_initialized():
            with stop_signals_held():
                ray.shutdown()


class _RowIter:
    """Good InputRows from an iterable, as a RowSource (``take`` blocks on the iterator)."""

    def __init__(self, rows: Iterable[InputRow]) -> None:
        self._rows = iter(rows)
        self.exhausted = False

    def take(self, max_rows: int, wait: bool) -> list[FeedItem]:
        taken: list[FeedItem] = []
        while len(taken) < max_rows:
            row = next(self._rows, None)
            if row is None:
                self.exhausted = True
                break
            taken.append(row)
        return taken


class _Run:
    """One ``process`` call's rows on their way: waiting per replica, suspects, rows parked
    until a chunk finishes (ray_chunks.py), and every row taken from the source with no
    result yet (``in_flight``, which bounds the pull)."""

    def __init__(self, pool: ReplicaPool, source: RowSource) -> None:
        self.pool = pool
        self.source = source
        self.pending: list[list[InputRow]] = [[] for _ in pool.slots]
        self.suspects: deque[Chunk] = deque()
        self.parked: deque[Chunk] = deque()
        self.in_flight: set[int] = set()

    @property
    def finished(self) -> bool:
        return self.source.exhausted and not self.in_flight

    def pull(
        self, max_in_flight: int, route: Callable[[InputRow, _Run], ReplicaSlot]
    ) -> list[ResultRow]:
        """Take rows up to ``max_in_flight`` and give each its replica; waits (briefly) only
        when no row is in flight. Returns the source's own error results, if any."""
        results: list[ResultRow] = []
        wait = not self.in_flight
        while not self.source.exhausted and len(self.in_flight) < max_in_flight:
            items = self.source.take(max_in_flight - len(self.in_flight), wait)
            if not items:
                break
            wait = False
            for item in items:
                if isinstance(item, ResultRow):
                    results.append(item)
                    continue
                row = item.row if isinstance(item, ReadyRow) else item  # replicas prepare
                self.in_flight.add(row.row_index)
                self.pending[route(row, self).index].append(row)
        return results

    def answered(self, results: list[ResultRow]) -> list[ResultRow]:
        """``results`` less those of rows answered already (each row is answered once)."""
        fresh = [r for r in results if r.row_index in self.in_flight]
        self.in_flight.difference_update(r.row_index for r in fresh)
        return fresh
