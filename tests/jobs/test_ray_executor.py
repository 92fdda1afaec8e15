"""The Ray executor on CPU with 2 replicas: the same rows as the local executor, a job that
was cancelled resumes under Ray, the input streams (bounded, each replica's engine kept full
across chunks) and cancel stops it. Replica failures: test_ray_failures.py.
One Ray session serves the whole file: Ray and each replica start slowly."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.jobs.job_helpers import (
    chat_rows,
    job_dict,
    read_jsonl_dir,
    run_cli,
    write_job,
    write_jsonl,
)
from tokenmill import run_job
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs import runner
from tokenmill.jobs.manifest import FingerprintMismatchError
from tokenmill.jobs.progress import Progress
from tokenmill.jobs.spec import JobSpec

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.usefixtures("ray_session")

from tokenmill.jobs.ray_executor import (  # noqa: E402
    CHUNKS_PER_REPLICA,
    RayExecutor,
    replica_resources,
)

BAD_LINES = [
    "{not json",
    json.dumps({"id": "r0001", "messages": [{"role": "user", "content": "duplicate"}]}),
    json.dumps({"id": "too-long", "messages": [{"role": "user", "content": "x" * 2000}]}),
]
# max_num_seqs 2 -> chunks of 2 rows: the 12 good rows make six, work for both replicas
SMALL = {"engine": {"max_num_seqs": 2}, "sampling": {"max_tokens": 6}}
PREFIX = "You are a careful counting assistant. " * 3
RAY = {"executor": "ray", "replicas": 2, "ray_address": None}


@pytest.fixture(scope="module")
def job_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rows = [json.dumps(r) for r in chat_rows(12)]
    lines = rows[:3] + BAD_LINES + rows[3:]
    return write_jsonl(tmp_path_factory.mktemp("ray") / "in.jsonl", lines)


@pytest.fixture(scope="module")
def local_outputs(tiny_model: Path, job_input: Path) -> dict[str, Any]:
    out = job_input.parent / "local"
    report = run_job(job_dict(tiny_model, job_input, out, **SMALL), show_progress=False)
    assert report.status == "complete"
    return _outputs(out)


def _outputs(out: Path) -> dict[str, Any]:
    """Every output row (id, text, finish_reason, token counts, passthrough) and error row,
    in shard order: equal dicts mean equal shard files."""
    return {"ok": read_jsonl_dir(out / "shards"), "errors": read_jsonl_dir(out / "errors")}


def test_ray_gives_the_same_rows_as_local(
    tiny_model: Path, job_input: Path, local_outputs: dict[str, Any]
) -> None:
    out = job_input.parent / "ray-same"
    spec = job_dict(tiny_model, job_input, out, execution=RAY, **SMALL)
    report = run_job(spec, show_progress=False)

    assert report.status == "complete" and report.executor == "ray"
    assert (report.rows_ok, report.rows_failed, report.rows_total) == (12, 3, 15)
    got = _outputs(out)
    assert len(got["ok"]) == 12 and len(got["errors"]) == 3
    assert got == local_outputs
    assert report.prefix_cache_hit_rate > 0  # the chat template's shared prefix, per replica
    # tokens counted from the replicas' counters; their model loads are load, not generation
    assert report.throughput_over_time[-1][1] == report.completion_tokens > 0
    assert report.generation_seconds > 0 and report.model_load_seconds > 0
    assert report.generation_seconds + report.model_load_seconds <= report.wall_seconds + 0.01


def test_a_replica_up_late_leaves_the_first_ones_work_in_generation_time(
    tiny_model: Path, job_input: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The defect: generation time began when the slowest replica was up, though the first
    generated meanwhile: 72 tokens "over 0.065 s of generation", 1,108 tok/s (the same job
    locally: 335), where the replicas ran for about 1 s. Here the second replica up is
    recorded as up 30 s late (a slow load), as the driver would see one: the first one's
    work stays generation time, and the late start is not model load."""
    late_s = 30.0
    note_up = RayExecutor._note_up

    def late_second(self: RayExecutor, event: Any) -> None:
        known = len(self._load_seconds)
        note_up(self, event)
        if known == 1 and len(self._load_seconds) == 2:
            self._load_seconds[event.slot.index] += late_s

    monkeypatch.setattr(RayExecutor, "_note_up", late_second)
    out = job_input.parent / "ray-late-replica"
    spec = job_dict(tiny_model, job_input, out, execution=RAY, **SMALL)
    report = run_job(spec, show_progress=False)

    assert report.status == "complete" and report.completion_tokens > 0
    assert 0 < report.output_tokens_per_s < float("inf")
    # tokens were generated from before the first sample that has any, to the last one
    first_t = next(t for t, tokens in report.throughput_over_time if tokens > 0)
    last_t = report.throughput_over_time[-1][0]
    assert report.generation_seconds >= last_t - first_t
    assert report.generation_seconds + report.model_load_seconds <= report.wall_seconds + 0.01


def test_more_replicas_than_the_cluster_has_room_for_still_finish_the_job(
    tiny_model: Path, job_input: Path, local_outputs: dict[str, Any]
) -> None:
    """The test cluster has 4 CPUs: the fifth replica never starts. Rows routed to it
    before any replica was up waited there forever (the job hung); they go to the replicas
    that came up."""
    out = job_input.parent / "ray-too-many"
    spec = job_dict(tiny_model, job_input, out, execution={**RAY, "replicas": 5}, **SMALL)
    report = run_job(spec, show_progress=False)
    assert report.status == "complete"
    assert _outputs(out) == local_outputs


def _cancel_at_first_shard(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event set when the runner hands its first complete shard to the writer: the
    run stops after that result, with that shard committed and later rows still to do.
    Deterministic, unlike watching the manifest, which the writer thread may update only
    after the engine has finished every row."""
    cancel = threading.Event()

    class Cancelling(runner.ShardWriter):
        def submit(self, shard: int, results: list[ResultRow]) -> None:
            super().submit(shard, results)
            cancel.set()

    monkeypatch.setattr(runner, "ShardWriter", Cancelling)
    return cancel


def test_ray_resumes_a_cancelled_job_with_every_row_once(
    tiny_model: Path,
    job_input: Path,
    local_outputs: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = job_input.parent / "resume"
    local = job_dict(tiny_model, job_input, out, **SMALL)
    cancel = _cancel_at_first_shard(monkeypatch)
    first = run_job(local, cancel=cancel, show_progress=False)
    monkeypatch.undo()
    assert first.status == "cancelled" and 0 < first.rows_this_run < 15

    resumed = run_job(
        job_dict(tiny_model, job_input, out, execution=RAY, **SMALL), show_progress=False
    )
    assert resumed.status == "complete" and resumed.executor == "ray"
    assert resumed.rows_resumed == first.rows_this_run
    assert first.rows_this_run + resumed.rows_this_run == 15
    assert _outputs(out) == local_outputs


def test_a_ray_resume_checks_and_records_the_resolved_dtype(
    tiny_model: Path, job_input: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model.dtype auto is float32 on these CPU replicas: progress made in bfloat16 (begun
    on a GPU) is refused, as a local resume refuses it, and a manifest without the dtype
    (a Ray run's, before it was recorded) gets the replicas'."""
    out = job_input.parent / "dtype"
    cancel = _cancel_at_first_shard(monkeypatch)
    run_job(job_dict(tiny_model, job_input, out, **SMALL), cancel=cancel, show_progress=False)
    monkeypatch.undo()
    path = out / "test.manifest.json"
    manifest = json.loads(path.read_text())
    manifest["settings"]["resolved_dtype"] = "bfloat16"
    path.write_text(json.dumps(manifest))
    ray_job = job_dict(tiny_model, job_input, out, execution=RAY, **SMALL)
    with pytest.raises(FingerprintMismatchError) as info:
        run_job(ray_job, show_progress=False)
    assert 'resolved_dtype: "bfloat16" -> "float32" (model.dtype auto on another' in str(info.value)

    del manifest["settings"]["resolved_dtype"]
    path.write_text(json.dumps(manifest))
    assert run_job(ray_job, show_progress=False).status == "complete"
    assert json.loads(path.read_text())["settings"]["resolved_dtype"] == "float32"


def test_executor_streams_through_every_replica_and_cancels(
    tiny_model: Path, tmp_path: Path
) -> None:
    spec = JobSpec.from_dict(
        job_dict(
            tiny_model,
            tmp_path / "unused.jsonl",
            tmp_path / "out",
            execution=RAY,
            engine={"max_num_seqs": 2},
            sampling={"max_tokens": 16, "ignore_eos": True},
        )
    )
    executor = RayExecutor(spec)
    assert (executor.chunk_rows, executor.max_in_flight) == (2, 16)
    pulled = 0

    def rows(n: int) -> Iterator[InputRow]:
        nonlocal pulled
        for i in range(n):
            pulled += 1
            prompt = f"{PREFIX}count to {i}"
            yield InputRow(i, f"r{i}", f"gen:{i}", prompt=prompt, passthrough={"i": i})

    cancel = threading.Event()
    watchdog = threading.Timer(120, cancel.set)  # a stalled stream fails instead of hanging
    watchdog.start()
    seen: list[int] = []
    pulled_at_first_result = None
    try:
        for result in executor.process(rows(10_000), cancel):
            if pulled_at_first_result is None:
                pulled_at_first_result = pulled
            assert result.ok and result.completion_tokens > 0, result
            assert result.passthrough == {"i": result.row_index}
            seen.append(result.row_index)
            if len(executor.counters_by_replica) == 2 and len(seen) >= 40:
                cancel.set()
        pulled_at_cancel = pulled
        stats, batches = executor.counters, executor.step_batches
        start = time.monotonic()
    finally:
        watchdog.cancel()
        executor.close()
    assert time.monotonic() - start < 30
    # results flow back while the input is read, never more than the in-flight cap ahead
    assert pulled_at_first_result is not None and pulled_at_first_result <= 16
    assert len(seen) == len(set(seen)) >= 40
    assert pulled_at_cancel <= len(seen) + 16  # it stopped pulling when cancelled
    # PREFIX spans whole KV blocks: cache hits
    assert stats.prefix_queried_tokens > 0 and stats.prefix_hit_tokens > 0
    # a steady feed: each engine ran a full batch (2 rows) at every step, with rows queued
    # behind it (it holds up to 4) at all but a few: the next chunks reach a replica before
    # its engine runs out, not after each chunk has drained (then it would never hold 4)
    assert batches.steps_below(2) == 0, batches
    assert batches.steps_below(3) <= batches.steps // 10, batches


def test_a_ray_runs_eta_bounds_a_row_by_the_replicas_context(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The bound on a row in the ETA came from the spec alone under Ray (its replicas load
    their engines later): max_tokens 100,000 ("no limit"), where the model's context is
    1,024 tokens, so a row in flight past every finished one read as running to 100,000
    tokens near the run's end. The replicas' context reaches the driver when one is up."""
    rows = [{"id": f"r{i}", "prompt": "x" * (1000 + i)} for i in range(4)]  # <= 24 tokens out
    spec = job_dict(
        tiny_model,
        write_jsonl(tmp_path / "in.jsonl", rows),
        tmp_path / "out",
        input={"prompt_column": "prompt", "messages_column": None, "passthrough_columns": []},
        sampling={"max_tokens": 100_000, "temperature": 0.0, "ignore_eos": True},
        execution={**RAY, "replicas": 1},
    )
    seen: list[Progress] = []
    report = run_job(spec, progress_interval_s=0.05, on_progress=seen.append)
    assert report.status == "complete" and report.rows_ok == 4
    assert seen[0].max_tokens == 1024  # the tiny model's max_position_embeddings


def test_replica_resources_and_chunk_sizes(tiny_model: Path, tmp_path: Path) -> None:
    def spec(device: str = "cpu", replicas: int = 1) -> JobSpec:
        execution = {**RAY, "replicas": replicas}
        raw = job_dict(
            tiny_model, tmp_path, tmp_path, engine={"device": device}, execution=execution
        )
        return JobSpec.from_dict(raw)  # engine.max_num_seqs 8

    assert replica_resources(spec("cpu"), cluster_gpus=8) == {"num_cpus": 1}
    assert replica_resources(spec("cuda"), cluster_gpus=0) == {"num_gpus": 1}
    assert replica_resources(spec("auto"), cluster_gpus=8) == {"num_gpus": 1}
    assert replica_resources(spec("auto"), cluster_gpus=0) == {"num_cpus": 1}

    ray_spec = spec(replicas=4)
    executor = RayExecutor(ray_spec)  # starts nothing until process()
    assert (executor.chunk_rows, executor.max_in_flight) == (8, CHUNKS_PER_REPLICA * 4 * 8)
    executor.close()
    small = RayExecutor(ray_spec, expected_rows=20)  # 2 chunks of 3 rows per replica
    assert (small.chunk_rows, small.max_in_flight) == (3, CHUNKS_PER_REPLICA * 4 * 3)
    small.close()


def test_no_stores_credentials_reach_a_replicas_arguments(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit: the whole job spec, storage_options' secrets included, went to every
    replica actor as its constructor's arguments, which Ray keeps in the cluster's state.
    A replica reads no input and writes no output: it is given neither's options."""
    from tokenmill.jobs import ray_executor

    given: list[dict[str, Any]] = []

    class Pool:
        def __init__(self, spec_dict: dict[str, Any], *args: Any, **kwargs: Any) -> None:
            given.append(spec_dict)

        def close(self) -> None:
            pass

    monkeypatch.setattr(ray_executor, "ReplicaPool", Pool)
    raw = job_dict(tiny_model, tmp_path / "in.jsonl", tmp_path / "out", execution=RAY)
    raw["input"]["storage_options"] = {"secret": "IN-SECRET"}
    raw["output"]["storage_options"] = {"token": "OUT-SECRET"}
    # nor an HTTP(S) input's password or presigned query (taken, and read by the driver)
    raw["input"]["path"] = "https://u:PW-SECRET@host/in.jsonl?X-Amz-Signature=SIG-SECRET"
    executor = RayExecutor(JobSpec.from_dict(raw))
    try:
        executor.start()
    finally:
        executor.close()
    (spec_dict,) = given
    assert "SECRET" not in json.dumps(spec_dict)
    JobSpec.from_dict(spec_dict)  # still a spec a replica can build its engine from


def test_a_model_a_replica_cannot_load_exits_2(
    tiny_model: Path, tmp_path: Path, job_input: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Damaged weights: a replica's load fails as the local one does (exit 2 naming
    model.source, 'rerunning does not help'), not as a failed job to rerun (exit 1)."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = shutil.copytree(tiny_model, tmp_path / "model")
    weights = model / "model.safetensors"
    tensors = load_file(weights)  # damaged inside: found only when a replica loads them
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    spec = job_dict(model, job_input, tmp_path / "out", execution={**RAY, "replicas": 1})
    assert run_cli(write_job(tmp_path, spec), "--quiet") == 2
    err = capsys.readouterr().err
    assert f"model.source '{model}' cannot be loaded on Ray replica 0" in err, err
    assert "model.norm.weight" in err and "NaN" in err


def test_a_replicas_kv_cache_too_small_for_the_context_names_the_setting(
    tiny_model: Path, tmp_path: Path, job_input: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The local executor's refusal (engine.max_model_len to set), not "model.source cannot
    be loaded", which blamed the model's files."""
    err = _refused_on_one_replica(tiny_model, tmp_path, job_input, capsys, 200_000)
    assert "engine: the KV cache holds 384 tokens, less than the 1024-token context" in err, err
    assert "(on Ray replica 0)" in err and "cannot be loaded" not in err


def _refused_on_one_replica(
    tiny_model: Path,
    tmp_path: Path,
    job_input: Path,
    capsys: pytest.CaptureFixture[str],
    kv_cache_memory: int,
) -> str:
    """Run the job on one Ray replica with ``engine.kv_cache_memory`` through the CLI; it must
    be refused with exit 2: its stderr."""
    spec = job_dict(tiny_model, job_input, tmp_path / "out", execution={**RAY, "replicas": 1},
                    engine={"kv_cache_memory": kv_cache_memory})  # fmt: skip
    assert run_cli(write_job(tmp_path, spec), "--quiet") == 2
    return capsys.readouterr().err


def test_a_kv_cache_memory_too_small_on_a_replica_names_the_setting(
    tiny_model: Path, tmp_path: Path, job_input: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KV cache too small for 2 blocks fails as the local executor's does (exit 2 naming
    engine.kv_cache_memory), not as "model.source cannot be loaded", which blamed the model."""
    err = _refused_on_one_replica(tiny_model, tmp_path, job_input, capsys, 1000)
    assert "engine.kv_cache_memory: expected room for at least 2 KV blocks" in err, err
    assert "(on Ray replica 0)" in err and "cannot be loaded" not in err


def test_a_lost_cluster_fails_the_run_with_its_report_and_exit_75(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """An audit: with the head gone mid-job nothing raised in Python; Ray's C++ core ended the
    driver 60 s later (exit 1, no report.json, only Ray's log line). The head's loss is
    injected where the driver notices it (the GCS watch's connect: killing a real head is
    60+ s and would end this test process): the run fails with its committed shards'
    report, exit 75, naming the cause."""
    import ray

    from tokenmill.jobs import ray_cluster_watch

    out = tmp_path / "out"
    # the head "goes away" once a shard is committed
    monkeypatch.setattr(ray_cluster_watch, "gcs_answers", lambda address: not _committed(out))
    monkeypatch.setattr(ray_cluster_watch, "LOST_AFTER_S", 0.5)
    monkeypatch.setattr(ray_cluster_watch, "_EVERY_S", 0.1)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(60))
    spec = job_dict(tiny_model, src, out, execution={"executor": "ray", "replicas": 1},
                    engine={"max_num_seqs": 2}, sampling={"max_tokens": 16})  # fmt: skip
    spec["output"]["rows_per_shard"] = 2
    job = write_job(tmp_path, spec)
    try:
        assert run_cli(job, "--quiet") == 75
    finally:  # the cluster is up in fact: the replicas the lost run left go
        for name in ray.util.list_named_actors():
            if name.startswith("tokenmill-"):
                ray.kill(ray.get_actor(name))
    assert "run-job: the Ray cluster went away: its head (GCS at " in capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed" and "ClusterLostError" in report["error"]
    assert report["shards_committed"] >= 1 and report["rows_this_run"] < 60


def test_a_head_lost_with_its_replicas_still_fails_the_run_with_exit_75(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A real head kill (`kill -9` of `ray start --head`'s process group): the replica on
    the head's node died with it, the pool started its replacement at once, and starting
    a named actor asks the GCS and waits: the driver hung there until Ray's C++ core ended
    it 60 s on (exit 1, no report.json), the GCS watch never consulted. Injected as in the
    test above, plus the replica's death: no replacement starts while the GCS is silent,
    and the run fails with exit 75."""
    import logging
    import os
    import signal

    import ray

    from tokenmill.jobs import ray_cluster_watch

    out = tmp_path / "out"
    head_gone = threading.Event()

    def kill_head_and_replica() -> None:  # once a shard is committed: the head, then its node
        deadline = time.monotonic() + 300
        while not _committed(out) and time.monotonic() < deadline:
            time.sleep(0.02)
        name = next(n for n in ray.util.list_named_actors() if n.startswith("tokenmill-"))
        pid = ray.get(ray.get_actor(name).ready.remote(), timeout=60).pid
        head_gone.set()
        os.kill(pid, signal.SIGKILL)

    monkeypatch.setattr(ray_cluster_watch, "gcs_answers", lambda *a, **k: not head_gone.is_set())
    # long enough for the driver to see its replica die before the watch gives up
    monkeypatch.setattr(ray_cluster_watch, "LOST_AFTER_S", 3.0)
    monkeypatch.setattr(ray_cluster_watch, "_EVERY_S", 0.1)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(60))
    ray_1 = {"executor": "ray", "replicas": 1}
    spec = job_dict(tiny_model, src, out, name="headloss", execution=ray_1,
                    engine={"max_num_seqs": 2}, sampling={"max_tokens": 16})  # fmt: skip
    spec["output"]["rows_per_shard"] = 2
    job = write_job(tmp_path, spec)
    killer = threading.Thread(target=kill_head_and_replica, daemon=True)
    killer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="tokenmill.jobs"):
            assert run_cli(job, "--quiet") == 75
        started = [n for n in ray.util.list_named_actors() if n.startswith("tokenmill-headloss-")]
    finally:  # the cluster is up in fact: the replicas the lost run left go
        killer.join(5)
        for name in ray.util.list_named_actors():
            if name.startswith("tokenmill-"):
                ray.kill(ray.get_actor(name))
    assert any("Ray replica 0 failed" in r.message for r in caplog.records)  # it died
    assert not any(n.endswith("-replica-0-1") for n in started), started  # none replaced it
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed" and "ClusterLostError" in report["error"]


def _committed(out: Path) -> bool:
    shards = out / "shards"
    return shards.exists() and any(shards.iterdir())
