"""Async scheduling (step n+1 scheduled before step n's tokens are read) changes nothing a
user sees: the same tokens, finish reasons, stop reasons and logprobs as the synchronous loop,
under stops discovered late, preemption, prefix caching, penalties, seeds and aborts."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.engine.core.test_scheduler import apply_sampled
from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.core import KVCacheManager
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.engine.outputs import RequestOutput

BLOCK = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("async") / "m")


def _llm(path: Path, async_scheduling: bool, **kwargs) -> LLM:
    return LLM(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        async_scheduling=async_scheduling,
        **kwargs,
    )


def _prompts(n: int, shared: int = 0) -> list[list[int]]:
    prefix = [(7 * t) % 250 + 5 for t in range(shared)]
    return [prefix + [(31 * i + 11 * t) % 250 + 5 for t in range(6 + i % 9)] for i in range(n)]


def _summary(outs: list[RequestOutput]) -> list[tuple]:
    return [
        (
            o.token_ids,
            o.text,
            o.finish_reason,
            o.stop_reason,
            None
            if o.logprobs is None
            else [(x.token_id, x.rank, sorted(x.top)) for x in o.logprobs],
        )
        for o in outs
    ]


def _params(reference: list[RequestOutput]) -> list[SamplingParams]:
    """A mix where several requests stop in ways the scheduler cannot foresee."""
    params = []
    for i, ref in enumerate(reference):
        kind = i % 6
        if kind == 0:
            params.append(SamplingParams(max_tokens=3 + i, temperature=0))
        elif kind == 1:  # a stop token met mid-stream
            params.append(
                SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[ref.token_ids[4]])
            )
        elif kind == 2:  # a stop string met mid-stream
            text = ref.text
            params.append(SamplingParams(max_tokens=24, temperature=0, stop=[text[6:9]]))
        elif kind == 3:  # penalties count the token still on the device
            params.append(
                SamplingParams(
                    max_tokens=20,
                    temperature=0,
                    presence_penalty=2.0,
                    frequency_penalty=0.3,
                    repetition_penalty=1.2,
                )
            )
        elif kind == 4:
            params.append(SamplingParams(max_tokens=16, temperature=0, logprobs=3))
        else:  # seeded sampling: the draw depends on the output position
            params.append(SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=i))
    return params


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        {"max_num_batched_tokens": 9},  # chunked prefill mixed with decodes
        {"kv_cache_memory": 2 * 2 * 10 * BLOCK * 2 * 16 * 4},  # 10 blocks: preemption
    ],
    ids=["plain", "chunked", "preempting"],
)
def test_async_matches_sync(model_path, engine_kwargs) -> None:
    prompts = _prompts(18, shared=9)
    probe = _llm(model_path, False).generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    params = _params(probe)
    sync = _llm(model_path, False, **engine_kwargs)
    want = sync.generate(prompts, params)
    llm = _llm(model_path, True, **engine_kwargs)
    got = llm.generate(prompts, params)
    assert _summary(got) == _summary(want)
    assert {o.finish_reason for o in got} >= {"stop", "length"}
    assert sum(o.num_cached_tokens for o in got) > 0
    if "kv_cache_memory" in engine_kwargs:
        # Blocks free a step later or earlier, so which prefix blocks survive may differ.
        assert llm.engine.scheduler.stats.num_preemptions > 0
    else:
        assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want]
    kv = llm.engine.scheduler.kv
    kv.check_integrity()
    assert kv.num_free_blocks == llm.engine.runner.num_blocks
    assert not llm.engine.has_unfinished()


def test_abort_in_flight_and_reuse_its_id(model_path) -> None:
    prompts = _prompts(4)
    greedy = SamplingParams(max_tokens=10, temperature=0)
    want = _llm(model_path, False).generate(prompts, greedy)
    engine = _llm(model_path, True).engine
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", p, greedy)
    done: dict[str, RequestOutput] = {}
    for _ in range(3):  # leaves a launched step whose rows include r1
        done.update((o.request_id, o) for o in engine.step())
    assert engine._in_flight is not None
    engine.abort_requests(["r1"])
    engine.add_request("r1", prompts[3], greedy)  # same id, new request, old row in flight
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    assert done["r0"].token_ids == want[0].token_ids
    assert done["r2"].token_ids == want[2].token_ids
    assert done["r1"].token_ids == want[3].token_ids
    assert engine.scheduler.kv.num_free_blocks == engine.runner.num_blocks


def test_reusing_the_id_of_an_output_still_being_built(model_path) -> None:
    """r0 finishes; its output is still being built (the builder's thread held) when r0 is
    aborted and a new r0 added: only the old output is dropped, the new one comes back."""
    prompts = _prompts(3)
    short, long = SamplingParams(max_tokens=3, temperature=0), SamplingParams(max_tokens=40)
    want = _llm(model_path, False).generate(prompts[1], short)[0]
    engine = _llm(model_path, True).engine
    build, gate = engine._outputs.build, threading.Event()

    def held(finished):
        gate.wait(10)
        return build(finished)

    engine._outputs.build = held
    engine.add_request("r0", prompts[0], short)
    engine.add_request("z", prompts[2], long)  # keeps the engine running meanwhile
    for _ in range(6):
        assert engine.step() == []  # r0's output waits behind the gate
    assert engine._outputs.pending
    engine.abort_requests(["r0"])
    engine.add_request("r0", prompts[1], short)
    for _ in range(6):  # the new r0 finishes too; its output queues behind the old one's
        assert engine.step() == []
    gate.set()
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id not in done
            done[o.request_id] = o
    assert sorted(done) == ["r0", "z"] and done["r0"].token_ids == want.token_ids


def test_scheduler_runs_ahead_by_one_token_and_stops_at_max_tokens() -> None:
    kv = KVCacheManager(64, BLOCK, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(4, 64, 64, async_scheduling=True), kv)
    req = Request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=2, temperature=0))
    sched.add_request(req)
    first = sched.schedule()  # the prompt; samples output 1
    assert first.scheduled[0].sample and req.num_pending_tokens == 1
    second = sched.schedule()  # output 1 (pending) as input; samples output 2
    row = second.scheduled[0]
    assert (row.start, row.num_new_tokens, row.sample) == (5, 1, True)
    assert req.num_pending_tokens == 2
    # Output 2 will be the last (max_tokens=2): nothing more is scheduled for it.
    assert sched.schedule().is_empty
    assert apply_sampled(sched, first, {"a": [11]}) == []
    assert req.num_pending_tokens == 1 and req.output_token_ids == [11]
    assert apply_sampled(sched, second, {"a": [12]}) == [req]
    assert req.status.value == "length" and req.output_token_ids == [11, 12]
    assert kv.num_free_blocks == 64


@pytest.mark.gpu
def test_gpu_async_matches_sync_and_launches_never_sync(model_path, monkeypatch) -> None:
    """On CUDA (Triton backend, CUDA graphs): the same outputs, and ``launch`` makes no call
    that synchronises the host with the device (torch's sync debug mode raises on one)."""
    import torch

    prompts = _prompts(18, shared=9)
    kwargs = dict(device="cuda", dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 26)
    probe = LLM(str(model_path), async_scheduling=False, **kwargs).generate(
        prompts, SamplingParams(max_tokens=24, temperature=0)
    )
    params = _params(probe)
    want = LLM(str(model_path), async_scheduling=False, **kwargs).generate(prompts, params)
    llm = LLM(str(model_path), async_scheduling=True, profile_steps=True, **kwargs)
    runner = llm.engine.runner
    launch = runner.launch

    def checked_launch(sched, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(sched, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(runner, "launch", checked_launch)
    got = llm.generate(prompts, params)
    assert _summary(got) == _summary(want)
    profile = llm.engine.step_profile()
    assert profile["decode"]["graph_steps"] > 0
