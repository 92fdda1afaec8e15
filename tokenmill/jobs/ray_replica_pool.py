"""ReplicaPool: the driver's view of its engine replicas (Ray actors) and their chunks.

    slot 0: actor ── ready() ─► up ── run(chunk) x <= 4 ─► ChunkDone
                                        └─ process died / engine raised ─► ReplicaLost
                                             (every chunk it held) ─► new actor ─► ready() ...

Each replica process is one Ray actor (EngineReplica) in a slot. When it fails, the pool
puts a new actor in its slot (it loads the model again, wherever Ray places it), and the lost
chunks come back to the executor, which decides where they run next (ray_chunks.py).

Ray's own recovery does not fit here, and is off:

- task retry (``max_task_retries=0``): a retry would rerun the lost chunks on the same
  replica, together, so a row that kills its replica would kill it again forever, and
  nothing would say which row it is;
- actor restart (``max_restarts=0``): a restarted actor is the same handle, so the driver
  cannot count deaths. A replica that dies while it loads (out of memory) would restart
  forever: Ray answers "restarting" to every ``ready()`` meanwhile, so retries of ``ready``
  count polls, not deaths. With a new actor per process, each start is one ``ready()``
  call: a replica whose model cannot load (its constructor raised) fails the job at once,
  and one that dies ``MAX_FAILED_STARTS`` times in a row before it is up fails it too,
  with ReplicaStartError, while a replica that keeps dying *after* it is up (poison rows)
  is replaced as often as needed.

An engine that raises leaves its process alive but unusable: the pool kills it first. So
does a replica that holds rows and has taken no engine step for ``stall_timeout_s``
(ray_stall_watch.py): a hung engine would otherwise hold its rows forever.
``poll`` waits (``ray.wait``) on every chunk in flight and every replica starting, and turns
what finished into typed events; the executor only ever sees events.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from tokenmill.jobs.ray_chunks import Chunk
from tokenmill.jobs.ray_replica import (
    ChunkResult,
    EngineReplica,
    ReplicaInfo,
    ReplicaModelError,
    ReplicaSettingsError,
)
from tokenmill.jobs.ray_stall_watch import StallWatch
from tokenmill.jobs.spec import JobSpecError

__all__ = [
    "MAX_FAILED_STARTS",
    "ChunkDone",
    "PoolEvent",
    "ReplicaLost",
    "ReplicaPool",
    "ReplicaSlot",
    "ReplicaStartError",
    "ReplicaUp",
]

log = logging.getLogger("tokenmill.jobs")

MAX_FAILED_STARTS = 3  # deaths of a replica in a row before it is up: the job fails
_EXTRA_CALLS = 2  # actor threads beyond the chunks in flight: ready() and steps()


class ReplicaStartError(RuntimeError):
    """A replica cannot start: its model does not load, or its process keeps dying."""


@dataclass(eq=False)
class ReplicaSlot:
    """One replica as the driver sees it: its actor (a new one after each failure), the
    chunks running there and whether it is up (``info``, None while it starts)."""

    index: int
    actor: Any = None  # ray.actor.ActorHandle
    running: dict[Any, Chunk] = field(default_factory=dict)  # ObjectRef -> chunk
    info: ReplicaInfo | None = None
    restarts: int = 0  # actors this slot has had, less one
    failed_starts: int = 0  # actors in a row that died before they were up
    isolated: bool = False  # running one suspect chunk, alone (ray_chunks.py)
    starting: Any = None  # the ObjectRef of its pending ready() call
    started_at: float = 0.0  # time.monotonic() when its current actor was started
    watch: StallWatch | None = None  # None: never declared stalled
    waits_for_cluster: bool = False  # no actor: the GCS did not answer when one was due

    @property
    def key(self) -> str:
        """The replica's name in per-replica counts: one per process (a restart's counts
        start from zero)."""
        base = f"replica-{self.index}"
        return base if not self.restarts else f"{base}.restart-{self.restarts}"

    @property
    def up(self) -> bool:
        return self.info is not None

    @property
    def rows_running(self) -> int:
        return sum(len(c) for c in self.running.values())


@dataclass(frozen=True)
class ReplicaUp:
    """A replica has loaded its model (for the first time, or after a restart)."""

    slot: ReplicaSlot
    info: ReplicaInfo


@dataclass(frozen=True)
class ChunkDone:
    slot: ReplicaSlot
    chunk: Chunk
    result: ChunkResult


@dataclass(frozen=True)
class ReplicaLost:
    """A replica failed with ``chunks`` in flight (all lost; none where it died while
    starting); a new one is starting. ``alone``: it held one chunk only, so the failure is
    that chunk's."""

    slot: ReplicaSlot
    chunks: list[Chunk]
    alone: bool
    reason: str


PoolEvent = ReplicaUp | ChunkDone | ReplicaLost


class ReplicaPool:
    """``replicas`` EngineReplica actors with ``resources`` each, named after the job (so
    ``ray list actors`` shows whose they are), each taking up to ``chunks_per_replica``
    chunks at once. Actors start at construction; ``close`` kills them."""

    def __init__(
        self,
        spec_dict: dict[str, Any],
        model_name: str,
        replicas: int,
        resources: dict[str, float],
        chunks_per_replica: int,
        stall_timeout_s: float | None = None,
        cluster_answers: Callable[[], bool] | None = None,
    ) -> None:
        self._args = (spec_dict, model_name)
        self._cluster_answers = cluster_answers  # whether the head's GCS answers now
        self._name = f"tokenmill-{spec_dict['name']}-{uuid.uuid4().hex[:8]}-replica"
        self._class = ray.remote(EngineReplica)
        self._options = {
            "max_restarts": 0,
            "max_task_retries": 0,
            "max_concurrency": chunks_per_replica + _EXTRA_CALLS,
            **resources,
        }
        self._model = model_name
        self._dropped: list[Any] = []  # calls of failed replicas, read only to release them
        self.slots = [
            ReplicaSlot(i, watch=None if stall_timeout_s is None else StallWatch(stall_timeout_s))
            for i in range(replicas)
        ]
        for slot in self.slots:
            self._start(slot)

    def submit(self, slot: ReplicaSlot, chunk: Chunk, alone: bool = False) -> None:
        """Send ``chunk`` to ``slot`` (which must be up); ``alone``: as a suspect, with
        nothing else there until it returns."""
        ref = slot.actor.run.remote(list(chunk.rows))
        if not slot.running and slot.watch is not None:  # busy from now: watched from now
            self._reset_watch(slot)
        slot.running[ref] = chunk
        slot.isolated = alone

    def poll(self, timeout: float) -> list[PoolEvent]:
        """What finished within ``timeout`` seconds (everything that finished, once one has).
        Raises ReplicaStartError for a replica that cannot start."""
        for slot in self.slots:
            if slot.waits_for_cluster:
                self._start(slot)
        self._release_dropped()
        owner = {ref: slot for slot in self.slots for ref in slot.running}
        owner.update({s.starting: s for s in self.slots if s.starting is not None})
        if not owner:
            time.sleep(timeout)
            return []
        refs = list(owner)
        done, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if done:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        events: list[PoolEvent] = []
        failed: list[tuple[Any, BaseException]] = []
        for ref in done:
            slot = owner[ref]
            try:
                value = ray.get(ref)
            except RayError as exc:  # the actor died, run() raised, the result was lost
                failed.append((ref, exc))
                continue
            if ref == slot.starting:
                slot.starting, slot.info, slot.failed_starts = None, value, 0
                events.append(ReplicaUp(slot, value))
            else:
                events.append(ChunkDone(slot, slot.running.pop(ref), value))
                slot.isolated = slot.isolated and bool(slot.running)
        for ref, exc in failed:  # after the successes: a chunk that finished is not lost
            slot = owner[ref]
            if ref == slot.starting:
                events.append(self._start_failed(slot, exc))
            elif ref in slot.running:  # not dropped already with an earlier failure
                events.append(self._lost(slot, self._reason(slot, exc)))
        return events + self._stalled()

    def _stalled(self) -> list[PoolEvent]:
        """Replicas holding rows whose engines stopped stepping: killed, their chunks lost."""
        now = time.monotonic()
        events: list[PoolEvent] = []
        for slot in self.slots:
            watch = slot.watch
            if watch is None or not slot.up or not slot.running:
                continue
            if watch.stalled(slot.actor, now):
                pid = slot.info.pid if slot.info else "?"
                reason = (
                    f"the replica's engine (pid {pid}) took no step for "
                    f"{now - watch.moved_at:.0f} s while it held rows (execution."
                    "stall_timeout_s): a hung engine"
                )
                self._kill(slot)
                events.append(self._lost(slot, reason))
        return events

    def close(self) -> None:
        """Kill every replica."""
        for slot in self.slots:
            self._kill(slot)
        self.slots = []

    def _start(self, slot: ReplicaSlot) -> None:
        """A new actor in ``slot``, and its ready() call; none yet while the head's GCS
        does not answer (``poll`` tries again). Starting a (named) actor asks the GCS and
        waits for its answer: with the head gone (its node's replicas die with it, so this
        is the next call) it waited until Ray ended the driver, 60 s on, exit 1 with no
        report, before the executor's GCS watch could fail the run (a real head kill)."""
        if self._cluster_answers is not None and not self._cluster_answers():
            if not slot.waits_for_cluster:
                log.warning("Ray replica %d waits for the Ray head to answer", slot.index)
            slot.actor, slot.info, slot.starting = None, None, None
            slot.waits_for_cluster = True
            return
        slot.waits_for_cluster = False
        name = f"{self._name}-{slot.index}"
        if slot.restarts:
            name += f"-{slot.restarts}"
        slot.actor = self._class.options(name=name, **self._options).remote(*self._args)
        slot.info = None
        slot.starting = slot.actor.ready.remote()
        slot.started_at = time.monotonic()
        if slot.watch is not None:
            self._reset_watch(slot)

    def _reset_watch(self, slot: ReplicaSlot) -> None:
        assert slot.watch is not None
        if slot.watch.asked is not None:  # an answer no longer wanted: released later
            self._dropped.append(slot.watch.asked)
        slot.watch.reset(time.monotonic())

    def _kill(self, slot: ReplicaSlot) -> None:
        try:
            ray.kill(slot.actor)
        except Exception as exc:  # gone already, with its Ray cluster
            log.debug("killing replica %d: %s", slot.index, exc)

    def _reason(self, slot: ReplicaSlot, exc: BaseException) -> str:
        """What ``exc`` (a failed call) says happened to ``slot``; kills a replica that may
        be alive, but not in a state to trust."""
        pid = slot.info.pid if slot.info else "?"
        if isinstance(exc, RayActorError):
            return (
                f"the replica's process (pid {pid}) died: killed, out of memory, or a crash "
                "in native code"
            )
        self._kill(slot)
        if isinstance(exc, RayTaskError):
            return f"the replica's engine raised {exc.cause}"
        # an object lost with its node, say: the replica's state is unknown too
        return f"Ray lost the replica's work ({type(exc).__name__}: {exc})"

    def _lost(self, slot: ReplicaSlot, reason: str) -> ReplicaLost:
        """``slot`` failed (and is dead or killed): every chunk it held is lost; a new actor
        takes its place."""
        chunks = list(slot.running.values())
        self._dropped.extend(slot.running)
        slot.running.clear()
        slot.isolated = False
        slot.restarts += 1
        self._start(slot)
        return ReplicaLost(slot, chunks, alone=len(chunks) == 1, reason=reason)

    def _start_failed(self, slot: ReplicaSlot, exc: BaseException) -> ReplicaLost:
        """A replica died while starting: a new one takes its place (it held no rows), or,
        where starting again cannot help, ReplicaStartError / JobSpecError."""
        if isinstance(exc, (ReplicaSettingsError, ReplicaModelError)):  # (Ray's error is
            said = str(exc.args[0] if exc.args else exc).splitlines()[-1]  # also their type)
            if isinstance(exc, ReplicaSettingsError):
                raise JobSpecError(f"{said} (on Ray replica {slot.index})") from None
            raise JobSpecError(
                f"model.source {self._model!r} cannot be loaded on Ray replica {slot.index}: {said}"
            ) from None
        if isinstance(exc, RayActorError) and exc.actor_init_failed:
            raise ReplicaStartError(
                f"a Ray replica could not load model.source {self._model!r}: {exc}. Every node "
                "that may host a replica needs tokenmill and the model at that path (or an "
                "alias it can resolve)"
            ) from None
        slot.failed_starts += 1
        if slot.failed_starts >= MAX_FAILED_STARTS:
            raise ReplicaStartError(
                f"Ray replica {slot.index} died {slot.failed_starts} times in a row while "
                f"starting with model.source {self._model!r} ({exc}); check the replica's "
                "memory (engine.kv_cache_memory, a smaller model) and the Ray worker logs"
            ) from None
        self._kill(slot)
        slot.restarts += 1
        self._start(slot)
        return ReplicaLost(slot, [], alone=False, reason=f"it died while starting: {exc}")

    def _release_dropped(self) -> None:
        """Read the finished calls of failed replicas (Ray logs an error never read)."""
        if not self._dropped:
            return
        done, self._dropped = ray.wait(self._dropped, num_returns=len(self._dropped), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:  # the failure is handled already
                log.debug("a failed replica's call: %s", type(exc).__name__)
