"""EngineReplica: one engine in a Ray actor, fed without a break from the chunks sent to it.

    driver ── run(chunk) ─┐  (up to 4 calls in flight, each on its own actor thread)
    driver ── run(chunk) ─┼─► prepare rows ─► inbox ─► engine thread: RowProcessor.process
    driver ── run(chunk) ─┘                               │ results, any order
        ◄── ChunkResult when the chunk's last row is done ◄┘ (routed by row index)

The actor is threaded (``max_concurrency``): each ``run`` call templates and tokenizes its
rows, puts them on the inbox and waits for them. One engine thread runs RowProcessor over
the inbox as a RowSource that never ends, so the engine tops itself up from whatever chunks
are there: it does not drain at a chunk's end as long as the driver keeps the next chunks in
flight. A chunk's results go back together, with the engine's running counts.

When the engine raises (a bad step, a CUDA error), its state is unknown: every chunk the
replica holds, and every later call, fails with ReplicaEngineError carrying the engine's
error, and the driver replaces the actor (ray_replica_pool.py). A process that dies fails
its calls with Ray's ActorDiedError, and is replaced the same way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray

from tokenmill.engine.engine_config import EngineSettingError
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.engine_counters import EngineCounters
from tokenmill.jobs.row_source import FeedItem
from tokenmill.jobs.spec import JobSpec
from tokenmill.jobs.step_batches import StepBatches

__all__ = ["ChunkResult", "EngineReplica", "ReplicaEngineError", "ReplicaInfo"]

log = logging.getLogger("tokenmill.jobs")

_WAIT_S = 0.1  # how long an idle engine thread waits for rows before re-checking its stop


class ReplicaEngineError(RuntimeError):
    """The replica's engine raised; the replica must restart before it runs anything."""


class ReplicaModelError(ValueError):
    """The replica cannot load the model (its files: an unsupported architecture, corrupt
    weights, a path missing on that node): a rerun does not help until it is fixed."""


class ReplicaSettingsError(ValueError):
    """The job's settings cannot run on the replica's engine (its KV cache holds less than
    the job's context, or too little for 2 blocks): a rerun does not help until they are
    changed."""


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica process that has loaded its model: its pid (one process per incarnation),
    its Ray node, how long the model took to load and its engine's context (a row's prompt
    and output tokens at most: the driver knows it only from here)."""

    pid: int
    node_id: str
    load_seconds: float
    max_model_len: int


@dataclass(frozen=True)
class ChunkResult:
    """One chunk's results, with the replica's running counts as of its last row."""

    results: list[ResultRow]
    counters: EngineCounters
    batches: StepBatches


@dataclass
class _Waiting:
    """A chunk inside the replica: the rows it still waits for, and its results so far."""

    rows: int
    results: list[ResultRow] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    result: ChunkResult | None = None  # set with ``done``, unless the engine failed


class _Inbox:
    """The engine thread's RowSource: rows of every chunk in flight, in arrival order."""

    def __init__(self) -> None:
        self._items: deque[FeedItem] = deque()
        self._ready = threading.Condition()

    @property
    def exhausted(self) -> bool:
        return False  # more chunks may come until the actor is stopped

    def __len__(self) -> int:
        return len(self._items)

    def put(self, items: list[FeedItem]) -> None:
        with self._ready:
            self._items.extend(items)
            self._ready.notify()

    def take(self, max_rows: int, wait: bool) -> list[FeedItem]:
        with self._ready:
            if wait and not self._items:
                self._ready.wait(_WAIT_S)
            return [self._items.popleft() for _ in range(min(max_rows, len(self._items)))]


class EngineReplica:
    """The body of a Ray actor (see the module docstring); built from the job spec as a dict
    (``model.source`` made absolute by the driver) and the model's name in results."""

    def __init__(self, spec_dict: dict[str, Any], model_name: str) -> None:
        # imported here: the driver imports this module too, and needs no engine
        from tokenmill.jobs.local_executor import ContextCutError, RowProcessor

        start = time.monotonic()
        self._load_error: str | None = None  # ready() raises it: a typed error reaches the
        self._settings_error: str | None = None  # driver from a method, but only as text
        try:  # from a constructor
            self._processor = RowProcessor(JobSpec.from_dict(spec_dict))
        except ContextCutError as exc:  # (a ValueError: the settings', not the model's)
            self._settings_error = str(exc)
            return
        except EngineSettingError as exc:  # checked against the device, as the local
            self._settings_error = f"engine.{exc}"  # executor's (runner._load_executor)
            return
        except (ValueError, FileNotFoundError) as exc:
            self._load_error = f"{type(exc).__name__}: {exc}"
            return
        self._processor.model_name = model_name  # the spec's own spelling, as local names it
        self._info = ReplicaInfo(
            os.getpid(),
            ray.get_runtime_context().get_node_id(),
            time.monotonic() - start,
            self._processor.max_model_len,
        )
        self._inbox = _Inbox()
        self._prepare_lock = threading.Lock()  # one tokenizer, several calling threads
        self._lock = threading.Lock()  # guards _waiting and _failure
        self._waiting: dict[int, _Waiting] = {}  # row index -> its chunk
        self._failure: str | None = None
        self._batches = StepBatches()
        self._steps = 0  # engine steps taken: what the driver's stall watch reads
        threading.Thread(target=self._serve, name="tokenmill-replica-engine", daemon=True).start()

    def ready(self) -> ReplicaInfo:
        """This process's pid, node and model load time. Raises ReplicaSettingsError when
        the job's settings cannot run on its engine, ReplicaModelError when the
        model did not load, ReplicaEngineError when its engine has failed."""
        if self._settings_error is not None:
            raise ReplicaSettingsError(self._settings_error)
        if self._load_error is not None:
            raise ReplicaModelError(self._load_error)
        self._check()
        return self._info

    def steps(self) -> int:
        """Engine steps taken so far (answered on an actor thread while the engine runs)."""
        return self._steps

    def run(self, rows: list[InputRow]) -> ChunkResult:
        """Run one chunk of good rows; returns when every row has its result. Raises
        ReplicaEngineError when the engine fails meanwhile (the chunk is lost)."""
        with self._prepare_lock:
            items = self._processor.prepare(rows)
        waiting = _Waiting(len(rows))
        with self._lock:
            self._check()
            for row in rows:
                self._waiting[row.row_index] = waiting
        self._inbox.put(items)
        waiting.done.wait()
        if waiting.result is None:
            raise ReplicaEngineError(self._failure or "the engine stopped")
        return waiting.result

    def _check(self) -> None:
        if self._failure is not None:
            raise ReplicaEngineError(self._failure)

    def _serve(self) -> None:
        """The engine thread: runs the inbox for as long as the process lives, unless the
        engine raises; then every chunk here fails, and so does every later call."""
        try:
            for result in self._processor.process(self._inbox, on_step=self._note_step):
                self._deliver(result)
            failure = "the engine stopped"  # the inbox never ends: not expected
        except BaseException as exc:
            log.exception("the replica's engine failed; its chunks are lost")
            failure = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._failure = failure
            lost = {id(w): w for w in self._waiting.values()}
            self._waiting.clear()
        for waiting in lost.values():
            waiting.done.set()

    def _note_step(self) -> None:
        self._steps += 1
        # rows registered and no longer in the inbox are in the engine (this step's finished
        # rows included: they are delivered after this call)
        self._batches.add(len(self._waiting) - len(self._inbox))

    def _deliver(self, result: ResultRow) -> None:
        with self._lock:
            waiting = self._waiting.pop(result.row_index)
        waiting.results.append(result)
        if len(waiting.results) == waiting.rows:
            counters = self._processor.counters
            waiting.result = ChunkResult(waiting.results, counters, self._batches.copy())
            waiting.done.set()
