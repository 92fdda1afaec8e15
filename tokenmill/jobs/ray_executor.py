"""The Ray executor: a Ray Data pipeline over an actor pool of engine replicas.

    driver (runner thread)                    Ray cluster
    feed rows ─► chunks ─► input queue ─► Read(_QueueFeed) ─► map_batches(_Replica) x replicas
        ▲                      (actor)        one block = one chunk   RowProcessor per actor
        └── yield ◄── result queue ◄── drain thread ◄── ds.iter_batches() ◄──┘

The runner's feed stays on the driver: it owns the global row order, duplicate-id detection
across files, skipping committed shards and the shard tracker; its reader thread reads ahead,
but it must be advanced on the runner's own thread (the tracker is not thread-safe). The
replicas template and tokenize their rows themselves. So ``process`` pulls rows itself,
packs them into chunks (``4 * max_num_seqs`` rows, fewer for small jobs so that every replica
gets work) and puts them on a Ray queue; one streaming read task turns each chunk into one
Ray Data block, and ``map_batches`` sends each block to one replica of a fixed actor pool
(each asking for ``tensor_parallel * pipeline_parallel`` GPUs when the engine runs on CUDA,
else one CPU). A background thread iterates the dataset and hands result chunks back;
``process`` yields them. At most 3 chunks per replica are in flight (one running, one queued
on the actor, one in transit), so memory stays bounded however large the input. Commits stay
on the driver, through the runner's exactly-once writer; a result arriving twice (a retried
Ray task) is dropped.

Progress: each result chunk carries its replica's running counts (EngineCounters, output
tokens included) and how long the replica took to load its model, so the driver's live counts
(``live``) are the replicas' counts summed, as of their last chunks, and the rows it has sent
and not had back; the slowest replica's load time is model load, not generation, time.

Ray Data emits a read task's output in blocks of ``DataContext.target_max_block_size``
(128 MiB): small blocks are held back and merged until that size or the end of the task,
which would stall a streaming read until its input ends. So each chunk travels as a
single-row block (its rows pickled: every passthrough value the reader produced round-trips
exactly), and this dataset's own context sets a one-byte target: every block is then emitted
as soon as it is read, and a one-row block is never sliced.

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
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy, Datasource, ReadTask
from ray.data.block import BlockMetadata
from ray.util.queue import Empty, Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.engine_counters import EngineCounters
from tokenmill.jobs.progress import LiveCounts
from tokenmill.jobs.spec import JobSpec

__all__ = ["RayExecutor", "replica_resources"]

log = logging.getLogger("tokenmill.jobs")

PAYLOAD = "payload"  # the one column of every block: a pickled chunk of rows or of results
_TASKS_PER_ACTOR = 2  # one running, one whose input is already on the actor's node
_POLL_S = 0.1  # how often a wait for results re-checks ``cancel``
_JOIN_S = 30.0  # how long close() waits for a cancelled pipeline's last chunks
_END = object()  # the drain thread's "the dataset is exhausted"


@dataclass(frozen=True)
class _ResultChunk:
    """What a replica returns for one chunk: its results, its engine's running counts and the
    seconds it took to load its model."""

    replica: str
    counters: EngineCounters
    results: list[ResultRow]
    load_seconds: float = 0.0


def replica_resources(spec: JobSpec, cluster_gpus: float) -> dict[str, float]:
    """Ray resources of one engine replica: ``tensor_parallel * pipeline_parallel`` GPUs when
    the engine runs on CUDA (``device: auto`` means: when the cluster has GPUs), else 1 CPU."""
    device = spec.engine.device
    on_gpu = cluster_gpus > 0 if device == "auto" else device.startswith("cuda")
    if on_gpu:
        return {"num_gpus": spec.model.tensor_parallel * spec.model.pipeline_parallel}
    return {"num_cpus": 1}


class RayExecutor:
    """``execution.replicas`` engine replicas as a Ray Data actor pool; the interface of
    RowProcessor. ``expected_rows`` (the input's row count, if known) only sizes the chunks.

    ``process`` re-raises what the pipeline raises (e.g. ActorDiedError naming the model
    path when a replica cannot load it). ``close`` stops the pipelines, and shuts Ray down
    when this executor started it.
    """

    def __init__(self, spec: JobSpec, expected_rows: int | None = None) -> None:
        self.spec = spec
        self.replicas = spec.execution.replicas
        self.chunk_rows = 4 * spec.engine.max_num_seqs
        if expected_rows:  # at least 2 chunks per replica, or some replicas would idle
            self.chunk_rows = min(self.chunk_rows, math.ceil(expected_rows / (2 * self.replicas)))
        self.max_in_flight = (_TASKS_PER_ACTOR + 1) * self.replicas * self.chunk_rows
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=spec.execution.ray_address, include_dashboard=False)
        elif spec.execution.ray_address is not None:
            log.info(
                "Ray is already initialised in this process; using it, not execution."
                "ray_address=%s",
                spec.execution.ray_address,
            )
        total = ray.cluster_resources()
        self._resources = replica_resources(spec, total.get("GPU", 0))
        for key, amount in self._resources.items():
            name = {"num_gpus": "GPU", "num_cpus": "CPU"}[key]
            if amount * self.replicas > total.get(name, 0):
                log.warning(
                    "execution.replicas=%d needs %g %s in all; the Ray cluster has %g now: "
                    "replicas wait for resources (fewer replicas, or a larger cluster)",
                    self.replicas,
                    amount * self.replicas,
                    name,
                    total.get(name, 0),
                )
        self._stats: dict[str, EngineCounters] = {}
        self._load_seconds: dict[str, float] = {}  # replica -> its model load time
        self._rows_in_flight = 0
        self._pipelines: list[_Pipeline] = []

    def process(
        self,
        rows: Iterable[InputRow],
        cancel: threading.Event | None = None,
        on_step: Callable[[], None] | None = None,
    ) -> Iterator[ResultRow]:
        """Run good rows through the replicas; yields one ResultRow per row, in any order.
        On ``cancel`` it stops pulling rows and returns; in-flight rows yield nothing.
        ``on_step`` is called at every poll for results (at least every 0.1 s)."""
        cancel = cancel or threading.Event()
        pipe = _Pipeline(self._build_dataset)
        self._pipelines.append(pipe)
        source = iter(rows)
        in_flight: set[int] = set()  # row indices sent and not answered yet
        chunk: list[InputRow] = []
        exhausted = False
        try:
            while not cancel.is_set():
                while not exhausted and len(in_flight) + len(chunk) < self.max_in_flight:
                    row = next(source, None)
                    if row is None:
                        exhausted = True
                        break
                    chunk.append(row)
                    if len(chunk) == self.chunk_rows:
                        pipe.send(chunk, in_flight)
                        chunk = []
                if chunk:  # at the cap or at the end: a partial chunk must not wait
                    pipe.send(chunk, in_flight)
                    chunk = []
                if exhausted:
                    pipe.end_input()
                    if not in_flight:
                        return
                self._rows_in_flight = len(in_flight)
                item = pipe.next_results(_POLL_S)
                if item is not None and item is not _END:
                    self._note_chunk(item)
                if on_step is not None:
                    on_step()
                if item is None:
                    continue
                if item is _END:
                    log.warning("the Ray pipeline ended with %d rows unanswered", len(in_flight))
                    return
                for result in item.results:
                    if result.row_index not in in_flight:
                        continue  # answered already (a retried task)
                    in_flight.discard(result.row_index)
                    self._rows_in_flight = len(in_flight)
                    yield result
                    if cancel.is_set():
                        return
        finally:
            self._rows_in_flight = 0
            pipe.stop()

    def _note_chunk(self, item: _ResultChunk) -> None:
        """Keep a result chunk's counts; say when a replica has loaded its model."""
        self._stats[item.replica] = item.counters
        if item.replica not in self._load_seconds:
            self._load_seconds[item.replica] = item.load_seconds
            log.info(
                "Ray replica %d of %d loaded the model in %.1f s",
                len(self._load_seconds),
                self.replicas,
                item.load_seconds,
            )

    @property
    def counters(self) -> EngineCounters:
        """The engines' counts (prefix cache, speculative drafts), summed over replicas."""
        return sum(self._stats.values(), EngineCounters())

    @property
    def load_seconds(self) -> float:
        """The slowest replica's model load so far (they load in parallel, inside ``process``)."""
        return max(self._load_seconds.values(), default=0.0)

    def live(self) -> LiveCounts:
        """The replicas' output tokens as of their last chunks, the rows sent and not answered,
        and the model load time inside ``process`` so far (for the progress line)."""
        return LiveCounts(self.counters.output_tokens, self._rows_in_flight, self.load_seconds)

    @property
    def counters_by_replica(self) -> dict[str, EngineCounters]:
        """Ray actor id -> its engine's counts, for each replica that answered so far."""
        return dict(self._stats)

    def close(self) -> None:
        """Stop every pipeline (Ray Data removes its actors); shut Ray down if we started it.
        A cancelled pipeline finishes the chunks its replicas are running (up to 30 s here;
        past that they finish in the background unless Ray is shut down)."""
        for pipe in self._pipelines:
            pipe.stop()
            pipe.join(_JOIN_S)
        self._pipelines.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def _build_dataset(self, input_queue: Queue) -> ray.data.Dataset:
        source = self.spec.model.source
        spec_dict = self.spec.to_dict()
        if os.path.exists(source):  # a relative path means the driver's directory
            spec_dict["model"]["source"] = os.path.abspath(source)
        ds = ray.data.read_datasource(
            _QueueFeed(input_queue), override_num_blocks=1, num_cpus=0
        ).map_batches(
            _Replica,
            fn_constructor_args=(spec_dict, source),
            batch_size=None,  # one block (one chunk) per call
            batch_format="pyarrow",
            compute=ActorPoolStrategy(
                size=self.replicas, max_tasks_in_flight_per_actor=_TASKS_PER_ACTOR
            ),
            **self._resources,
        )
        ds.context.target_max_block_size = 1  # emit each block at once (module docstring)
        ds.context.enable_progress_bars = False  # the runner shows its own
        return ds


class _Pipeline:
    """One execution of the dataset: its input queue actor and the thread draining it."""

    def __init__(self, build: Callable[[Queue], ray.data.Dataset]) -> None:
        here = ray.get_runtime_context().get_node_id()
        self.input = Queue(
            actor_options={
                "num_cpus": 0,
                "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=True),
            }
        )
        self.output: queue.Queue[Any] = queue.Queue()
        self._ended = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._drain,
            args=(build(self.input),),
            name="tokenmill-ray-results",
            daemon=True,
        )
        self._thread.start()

    def send(self, chunk: list[InputRow], in_flight: set[int]) -> None:
        in_flight.update(r.row_index for r in chunk)
        self.input.put(pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL))

    def end_input(self) -> None:
        if not self._ended:
            self._ended = True
            self.input.put(None)

    def next_results(self, timeout: float) -> Any:
        """A _ResultChunk, _END, or None when nothing came within ``timeout`` seconds.
        Re-raises an error of the pipeline."""
        try:
            item = self.output.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """Drop the chunks no replica took yet and end the input; the drain thread quits at
        its next result (or at the end, whichever comes first)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._ended:
            return
        try:
            try:
                self.input.get_nowait_batch(self.input.qsize())
            except Empty:  # the read task took some meanwhile: they are in flight
                pass
            self.end_input()
        except Exception as exc:  # the queue actor is gone, and the read task with it
            log.debug("stopping the Ray pipeline: %s", exc)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the Ray pipeline is still finishing in-flight chunks after %g s", timeout)
        if ray.is_initialized():
            ray.kill(self.input.actor)

    def _drain(self, ds: ray.data.Dataset) -> None:
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                for payload in batch.column(PAYLOAD).to_pylist():
                    self.output.put(pickle.loads(payload))
                if self._stopping.is_set():
                    break  # closing the iterator shuts the execution and its actors down
            self.output.put(_END)
        except BaseException as exc:  # handed to process(), which re-raises it
            self.output.put(exc)


class _QueueFeed(Datasource):
    """A Ray Data source with one streaming read task: each pickled chunk taken off the input
    queue becomes a one-row block, until ``None`` ends the stream."""

    def __init__(self, input_queue: Queue) -> None:
        super().__init__()
        self._queue = input_queue

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, *args: Any, **kwargs: Any) -> list[ReadTask]:
        q = self._queue

        def read() -> Iterator[pa.Table]:
            while (payload := q.get()) is not None:
                yield pa.table({PAYLOAD: pa.array([payload], type=pa.large_binary())})

        return [ReadTask(read, BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None))]


class _Replica:
    """One engine replica, built once per Ray Data actor; each call runs one chunk."""

    def __init__(self, spec_dict: dict[str, Any], model_name: str) -> None:
        # imported here: the read task's worker imports this module too, and needs no torch
        from tokenmill.jobs.local_executor import RowProcessor

        start = time.monotonic()
        self.processor = RowProcessor(JobSpec.from_dict(spec_dict))
        self.load_seconds = time.monotonic() - start
        self.processor.model_name = model_name  # the spec's own spelling, as local names it
        self.replica = ray.get_runtime_context().get_actor_id()

    def __call__(self, batch: pa.Table) -> pa.Table:
        out = []
        for payload in batch.column(PAYLOAD).to_pylist():
            results = list(self.processor.process(pickle.loads(payload)))
            chunk = _ResultChunk(self.replica, self.processor.counters, results, self.load_seconds)
            out.append(pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL))
        return pa.table({PAYLOAD: pa.array(out, type=pa.large_binary())})
