"""Grammars in worker processes (``structured_output_processes``): the same outputs as the
grammars in the engine's process, on both libraries, with async scheduling; a constraint
the library rejects is refused when the request is added; a worker that dies stops the
engine with an error naming it; close() ends the workers."""

from __future__ import annotations

import gc
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.engine.test_structured_async import (
    _check_valid,
    _llm,
    _params,
    _prompts,
    _summary,
    tiny_path,  # noqa: F401  (the module's tiny model fixture)
)
from tokenmill import SamplingParams
from tokenmill.engine.engine_config import EngineConfig, EngineSettingError
from tokenmill.engine.grammar_processes import (
    GrammarProcesses,
    TokenizerNotPicklable,
    auto_processes,
    usable_cpus,
)
from tokenmill.engine.structured_output_params import TAKEN


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_worker_processes_give_the_in_process_outputs(tiny_path, backend) -> None:  # noqa: F811
    if backend == "xgrammar":
        pytest.importorskip("xgrammar")
    prompts, params = _prompts(12), _params(12)
    kwargs = dict(max_num_seqs=5, structured_output_backend=backend)  # rows come and go
    want = _llm(tiny_path, True, **kwargs).generate(prompts, params)
    llm = _llm(tiny_path, True, structured_output_processes=2, **kwargs)
    got = llm.generate(prompts, params)
    assert _summary(got) == _summary(want)
    _check_valid(got, params)
    grammars = llm.engine._grammars
    pool = grammars.backend
    assert isinstance(pool, GrammarProcesses) and pool.name == backend
    profile = llm.engine.step_profile()
    assert len(grammars) == 0 and profile["synchronous_steps"] == 0
    assert profile["structured_output"]["processes"] == 2 == grammars.processes
    # The workers wrote the masks into the engine's two mask buffers, no scratch copy.
    assert set(pool._segments) == {0, 1}
    procs = list(pool._procs)
    assert len(procs) == 2 and all(p.poll() is None for p in procs)
    llm.engine.close()
    assert all(p.poll() is not None for p in procs)
    assert not pool._segments


def test_a_rejected_constraint_is_refused_when_added(tiny_path) -> None:  # noqa: F811
    pytest.importorskip("xgrammar")
    llm = _llm(
        tiny_path, False, structured_output_backend="xgrammar", structured_output_processes=2
    )
    case_insensitive = SamplingParams(structured_output="regex:(?i)abc")  # llguidance's syntax
    with pytest.raises(ValueError, match=r"xgrammar cannot use this regex"):
        llm.engine.add_request("bad", [5, 6], case_insensitive)
    assert not llm.engine.has_unfinished()
    llm.engine.close()


def _json_rows_on_two_workers(path: Path) -> Any:
    """An LLM with grammars in 2 worker processes, 4 JSON rows added and one step taken."""
    llm = _llm(path, True, structured_output_processes=2)
    params = SamplingParams(max_tokens=30, temperature=0, structured_output="json_object")
    for i, prompt in enumerate(_prompts(4)):
        llm.engine.add_request(f"r{i}", prompt, params)
    llm.engine.step()
    return llm


def test_a_dead_worker_stops_the_engine_naming_it(tiny_path) -> None:  # noqa: F811
    llm = _json_rows_on_two_workers(tiny_path)
    victim = llm.engine._grammars.backend._procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    with pytest.raises(RuntimeError, match=rf"grammar worker process 1 \(pid {victim.pid}\)"):
        while llm.engine.has_unfinished():
            llm.engine.step()
    llm.engine.close()


def test_a_stalled_worker_stops_the_engine_naming_it(tiny_path) -> None:  # noqa: F811
    llm = _json_rows_on_two_workers(tiny_path)
    pool = llm.engine._grammars.backend
    pool.answer_timeout_s = 0.5
    victim = pool._procs[0]
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        message = rf"grammar worker process 0 \(pid {victim.pid}\) has not answered in 0.5 s"
        with pytest.raises(RuntimeError, match=message):
            while llm.engine.has_unfinished():
                llm.engine.step()
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    llm.engine.close()
    assert victim.poll() is not None


def test_workers_ignore_signals_to_the_engines_process_group(tiny_path) -> None:  # noqa: F811
    """A Ctrl-C or a SIGTERM to the job's group is the engine's to handle (it stops at a
    commit boundary, with its grammars): the workers are not in that group."""
    llm = _json_rows_on_two_workers(tiny_path)
    for proc in llm.engine._grammars.backend._procs:
        assert os.getpgid(proc.pid) != os.getpgid(0)
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.close()


def test_a_negative_process_count_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="structured_output_processes"):
        EngineConfig(model="m", structured_output_processes=-1)


@pytest.mark.parametrize("processes", [65, 10**12])
def test_more_processes_than_a_host_could_run_are_refused(processes: int) -> None:
    """An audit: structured_output_processes=10**12 passed, and the first structured
    request had the engine start worker interpreters one after another until the host
    gave out; now refused with the settings, naming the range."""
    said = r"^structured_output_processes: expected an integer from 0 to 64, or unset"
    with pytest.raises(EngineSettingError, match=said):
        EngineConfig(model="m", structured_output_processes=processes)
    assert EngineConfig(model="m", structured_output_processes=64).structured_output_processes == 64


@pytest.mark.parametrize(("cores", "cuda", "cpu"), [(16, 8, 0), (40, 8, 0), (6, 3, 0), (1, 1, 0)])
def test_unset_processes_are_a_worker_per_two_cores_on_cuda_and_none_on_cpu(
    monkeypatch, cores: int, cuda: int, cpu: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert (auto_processes("cuda"), auto_processes("cpu")) == (cuda, cpu)
    assert EngineConfig(model="m").structured_output_processes is None


def test_without_an_affinity_the_machines_cpus_count(monkeypatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    assert usable_cpus() == 12 and auto_processes("cuda") == 6


def test_unset_processes_keep_the_grammars_here_when_the_tokenizer_does_not_pickle(
    tiny_path,  # noqa: F811
    caplog,
) -> None:
    """Processes chosen by default fall back to the engine's process, with a warning; asked
    for, they refuse (the test above)."""
    from tokenmill.engine.core.request import Request
    from tokenmill.engine.grammar_llguidance import LlguidanceGrammars
    from tokenmill.engine.loader import resolve_model_source
    from tokenmill.engine.structured_output import StructuredOutputs

    tokenizer = resolve_model_source(str(tiny_path)).load_tokenizer()
    tokenizer.unpicklable = lambda: None
    eos = [tokenizer.eos_token_id]
    params = SamplingParams(structured_output='choice:["ab", "cd"]')
    asked = StructuredOutputs(tokenizer, 288, eos, None, "llguidance", 2)
    with pytest.raises(TokenizerNotPicklable, match="structured_output_processes"):
        asked.add(Request("r0", [5, 6], params))
    grammars = StructuredOutputs(tokenizer, 288, eos, None, "llguidance", 2, fallback=True)
    reqs = [Request(f"r{i}", [5, 6], params) for i in range(2)]
    with caplog.at_level("WARNING"):
        for req in reqs:
            grammars.add(req)
    assert isinstance(grammars.backend, LlguidanceGrammars)
    assert "stay in the engine's process" in caplog.text
    masks = grammars.bitmask(reqs)
    assert masks.shape == (2, 9) and masks.any(axis=1).all()
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    grammars.feed(reqs, [a, a])
    assert grammars.take_ended() == []
    grammars.close()


def test_masks_into_any_array_and_workers_stopped_when_the_pool_is_collected(
    tiny_path,  # noqa: F811
) -> None:
    from tokenmill.engine.grammar_llguidance import LlguidanceGrammars
    from tokenmill.engine.loader import resolve_model_source

    tokenizer = resolve_model_source(str(tiny_path)).load_tokenizer()
    eos = [tokenizer.eos_token_id]
    pool = GrammarProcesses("llguidance", tokenizer, 288, eos, 2)
    alone = LlguidanceGrammars(tokenizer, 288, eos, threads=1)
    specs = ["json_object", "regex:[a-c]{2,6}-[0-9]{1,3}", "json_object"]
    rows = [pool.matcher(spec) for spec in specs]
    want_rows = [alone.matcher(spec) for spec in specs]
    first = [tokenizer.encode(t, add_special_tokens=False)[0] for t in ("{", "a", "{")]
    got_status, want_status = pool.consume(rows, first), alone.consume(want_rows, first)
    assert got_status.tolist() == want_status.tolist() == [TAKEN] * 3
    got, want = np.zeros((5, 9), np.int32), np.zeros((5, 9), np.int32)  # 288 tokens: 9 words
    pool.fill(rows, got, at=[4, 0, 2])  # a plain array: through the scratch buffer
    alone.fill(want_rows, want, at=[4, 0, 2])
    assert (got == want).all() and got[[0, 2, 4]].any() and not got[[1, 3]].any()
    procs = list(pool._procs)
    names = [shm.name for shm, *_ in pool._segments.values()]
    assert names and all(os.path.exists(f"/dev/shm/{n}") for n in names)
    del pool
    gc.collect()
    assert all(p.poll() is not None for p in procs)
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)  # not left behind


@pytest.mark.parametrize("processes", [0, 1])
def test_a_closed_llm_refuses_work_and_its_workers_do_not_start_again(
    tiny_path,  # noqa: F811
    processes: int,
) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, structured_output="json_object")
    with _llm(tiny_path, False, structured_output_processes=processes) as llm:
        assert llm.generate([[5, 6, 7]], params)[0].token_ids
    pool = llm.engine._grammars.backend
    with pytest.raises(RuntimeError, match="this engine was closed"):
        llm.generate([[5, 6, 7]], params)
    llm.close()  # twice is fine
    if processes:
        assert not pool._procs and not pool._segments
        with pytest.raises(RuntimeError, match="were closed"):
            pool.matcher("json_object")


def test_released_matchers_are_dropped_with_the_next_consume(tiny_path) -> None:  # noqa: F811
    """Released keys travel in the next step's message to their worker, also to a worker
    that has nothing else that step (it answers nothing then, so the answers after stay
    its own); a fill naming a dropped key finds no matcher there."""
    from tokenmill.engine.loader import resolve_model_source

    tokenizer = resolve_model_source(str(tiny_path)).load_tokenizer()
    pool = GrammarProcesses("llguidance", tokenizer, 288, [tokenizer.eos_token_id], 2)
    keys = [pool.matcher("json_object") for _ in range(4)]  # workers 0, 1, 0, 1
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    pool.release([keys[1], keys[2]])
    assert pool.consume([keys[0]], [brace]).tolist() == [TAKEN]  # worker 1: drops only
    assert not pool._released
    masks = np.zeros((2, 9), np.int32)
    pool.fill([keys[0], keys[3]], masks)  # both workers answer their own fill
    assert masks.all(axis=1).tolist() == [False, False] and masks.any(axis=1).all()
    assert (masks[0] != masks[1]).any()  # after "{" against the start
    with pytest.raises(RuntimeError, match="grammar worker process 1"):
        pool.fill([keys[1]], masks)  # dropped: the worker has no matcher for it
    pool.close()


def test_a_tokenizer_that_cannot_be_pickled_is_refused_naming_the_setting(tiny_path) -> None:  # noqa: F811
    from tokenmill.engine.loader import resolve_model_source

    tokenizer = resolve_model_source(str(tiny_path)).load_tokenizer()
    tokenizer.unpicklable = lambda: None  # a lambda does not pickle
    pool = GrammarProcesses("llguidance", tokenizer, 288, [tokenizer.eos_token_id], 2)
    with pytest.raises(ValueError, match="structured_output_processes.*cannot be handed"):
        pool.matcher("json_object")
    assert not pool._procs


def _three_choice_rows(path: Path) -> tuple[Any, Any, list[Any]]:
    """(tokenizer, grammars in 2 worker processes, three requests choosing "ab" or "cd",
    each with its first mask handed out)."""
    from tokenmill.engine.core.request import Request
    from tokenmill.engine.loader import resolve_model_source
    from tokenmill.engine.structured_output import StructuredOutputs

    tokenizer = resolve_model_source(str(path)).load_tokenizer()
    grammars = StructuredOutputs(tokenizer, 288, [tokenizer.eos_token_id], None, "llguidance", 2)
    params = SamplingParams(structured_output='choice:["ab", "cd"]')
    reqs = [Request(f"r{i}", [5, 6], params) for i in range(3)]
    for req in reqs:
        grammars.add(req)
    grammars.bitmask(reqs)
    return tokenizer, grammars, reqs


def test_a_feed_to_the_workers_is_answered_when_its_outcome_is_needed(tiny_path) -> None:  # noqa: F811
    tokenizer, grammars, reqs = _three_choice_rows(tiny_path)
    a, b, c = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("a", "x", "c"))
    grammars.feed(reqs, [a, b, c])  # the second row's token is not allowed
    pending = grammars._fed_pending
    assert pending is not None and pending.sent is None  # kept for the next step's message
    assert grammars.take_ended() == ["r1"]  # sent alone, then read
    assert grammars._fed_pending is None
    grammars.drop(["r1"])
    masks = grammars.bitmask([reqs[0], reqs[2]])  # reads nothing pending, fills two rows
    assert masks.shape == (2, 9) and masks.any(axis=1).all()
    b = tokenizer.encode("b", add_special_tokens=False)[0]
    grammars.feed([reqs[0], reqs[2]], [b, b])  # "ab" completes the first choice; "cb" is refused
    masks = grammars.bitmask([reqs[0], reqs[2]])  # the tokens go out with this fill
    assert grammars._fed_pending is None  # and were read before it
    assert masks.shape == (2, 9)
    assert sorted(grammars.take_ended()) == ["r0", "r2"]
    grammars.close()


@pytest.mark.parametrize("sent", [False, True], ids=["feed-unsent", "feed-sent-unread"])
def test_a_dropped_requests_feed_outcome_is_not_its_reused_ids(tiny_path, sent) -> None:  # noqa: F811
    """With worker processes a feed's outcome is read later. A request dropped (aborted)
    after its refused token was fed: unsent, the feed went out after the drop and the worker
    died on the dropped matcher; sent and unread, its id given at once to a new request had
    the old grammar's rejection read as the new one's (the new request ended before its
    first token). A review; only direct LLMEngine users reuse ids."""
    from tokenmill.engine.core.request import Request

    tokenizer, grammars, reqs = _three_choice_rows(tiny_path)
    a, x = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("a", "x"))
    grammars.feed(reqs, [a, x, a])  # r1's token is refused: its outcome not read yet
    pending = grammars._fed_pending
    assert pending is not None
    if sent:  # as a fill beside the engine's other work sends it (``_while_masks_fill``)
        pending.sent = grammars.backend.send_step(pending.consumed())
    grammars.drop(["r1"])
    again = Request("r1", [5, 6], SamplingParams(structured_output='choice:["ab", "cd"]'))
    grammars.add(again)
    assert grammars.take_ended() == []
    assert grammars.rejection("r1") is None
    masks = grammars.bitmask([again])  # the new grammar in its start state
    assert masks.any()
    grammars.close()


def test_work_beside_the_fill_that_raises_leaves_the_workers_answers_read(tiny_path) -> None:  # noqa: F811
    """With worker processes the step in flight is processed on the engine's thread while
    they fill; if that raises, their answers are still read, so the next step's are its own."""
    tokenizer, grammars, reqs = _three_choice_rows(tiny_path)
    a, c = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("a", "c"))
    grammars.feed(reqs, [a, c, a])

    def fails() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        grammars.bitmask(reqs, beside=fails)
    assert grammars._fed_pending is None  # the tokens' answers were read
    b, d = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("b", "d"))
    grammars.feed(reqs, [b, d, b])  # each row completes its choice
    masks = grammars.bitmask(reqs)
    assert masks.shape == (3, 9)
    assert sorted(grammars.take_ended()) == ["r0", "r1", "r2"]
    grammars.close()


@pytest.mark.parametrize("masks_in", [True, False], ids=["masks-in-first", "masks-in-last"])
def test_the_next_step_is_scheduled_ahead_only_while_the_masks_are_not_in(
    tiny_path,  # noqa: F811
    monkeypatch,
    masks_in: bool,
) -> None:
    """Once the step in flight is processed beside the fill, the engine schedules the next
    step there only if the workers have not answered yet; either way the outputs are the
    in-process grammars'."""
    prompts, params = _prompts(12), _params(12)
    kwargs = dict(max_num_seqs=5)
    want = _llm(tiny_path, True, **kwargs).generate(prompts, params)
    llm = _llm(tiny_path, True, structured_output_processes=2, **kwargs)
    grammars = llm.engine._grammars
    asked: list[bool] = []
    answered = grammars.backend.answered

    def masks_in_now() -> bool:
        assert grammars._filling is not None  # only asked beside a fill
        asked.append(answered(grammars._filling))
        return masks_in

    monkeypatch.setattr(grammars, "masks_in", masks_in_now)
    ahead = 0
    schedule = llm.engine.scheduler.schedule

    def counting(*args: Any, **kw: Any) -> Any:
        nonlocal ahead
        ahead += grammars._filling is not None  # a call from beside a fill
        return schedule(*args, **kw)

    monkeypatch.setattr(llm.engine.scheduler, "schedule", counting)
    got = llm.generate(prompts, params)
    assert _summary(got) == _summary(want)
    assert len(asked) > 5
    assert ahead == (0 if masks_in else len(asked))
    assert llm.engine.step_profile()["synchronous_steps"] == 0


def test_answered_says_when_every_worker_has_answered(tiny_path) -> None:  # noqa: F811
    from tokenmill.engine.loader import resolve_model_source

    tokenizer = resolve_model_source(str(tiny_path)).load_tokenizer()
    pool = GrammarProcesses("llguidance", tokenizer, 288, [tokenizer.eos_token_id], 2)
    rows = [pool.matcher("json_object") for _ in range(4)]
    masks = pool.shared_masks(0, 4, pinned=False)
    pool.fill(rows, masks)
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    places = np.arange(4)
    sent = pool.send_step((rows, [brace] * 4, None), (rows, masks, places, None))
    assert not pool.answered(sent)  # its statuses unread: a waiting answer may be them
    status, took = pool.finish_consume(sent)
    assert status.tolist() == [TAKEN] * 4 and took.tolist() == [1] * 4
    deadline = time.monotonic() + 30
    while not pool.answered(sent):  # the workers answer within milliseconds
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert pool.answered(sent)  # answered stays answered until read
    pool.finish_fill(sent)
    sent = pool.send_step(fill=(rows, masks, places, None))
    while not pool.answered(sent):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    pool.finish_fill(sent)
    pool.close()


def test_a_worker_releases_the_matchers_of_finished_requests() -> None:
    """A worker drops a finished request's matcher and tells its backend (xgrammar keeps
    per-matcher state by id(), which a later matcher reusing the address inherited)."""
    import threading
    from multiprocessing import Pipe

    from tokenmill.engine.grammar_processes import ADD, STEP, STOP, _message, _serve

    class Recorder:
        released: list = []

        def matcher(self, spec: str) -> tuple[str, bool]:
            return spec, True

        def release(self, rows: list) -> None:
            self.released.extend(rows)

    engine, worker = Pipe()
    backend = Recorder()
    serving = threading.Thread(target=_serve, args=(worker, backend), daemon=True)
    serving.start()
    engine.send_bytes(_message(ADD, [7], text="spec-a"))
    engine.send_bytes(_message(ADD, [8], text="spec-b"))
    # slot 0, two keys to drop (7 and an unknown one), nothing to consume or fill
    engine.send_bytes(_message(STEP, [0, 2, 0, 0, 0, 0], [7, 99]))
    engine.send_bytes(_message(STOP))
    serving.join(10)
    assert backend.released == [("spec-a", True)]


def test_checked_specs_are_bounded(tiny_path) -> None:  # noqa: F811
    """A job with a schema per row: the specs the engine compiled to check stay bounded."""
    llm = _llm(tiny_path, True, structured_output_processes=1)
    pool = llm.engine._grammars.backend
    for i in range(80):
        pool.matcher("regex:" + "a" * (i + 1))
    assert len(pool._checked) == 64 and "regex:" + "a" * 80 in pool._checked
    llm.engine.close()


def test_an_llm_cut_short_mid_message_runs_the_next_call_as_a_fresh_one(tiny_path) -> None:  # noqa: F811
    """Ctrl-C lands while a step's message to a grammar worker is half written: the call
    raises KeyboardInterrupt, and the next call gives a fresh LLM's outputs (the runner had
    refused every later launch, and the workers read the next message out of step)."""
    import struct

    prompts, params = _prompts(8), _params(8)
    kwargs = dict(max_num_seqs=5, structured_output_processes=2)
    want = _summary(_llm(tiny_path, True, **kwargs).generate(prompts, params))
    llm = _llm(tiny_path, True, **kwargs)
    pool = llm.engine._grammars.backend
    send, sent = GrammarProcesses._send, [0]

    def cut(self, worker: int, message: bytes) -> None:
        sent[0] += 1
        if sent[0] == 12:  # some steps in: half the message, then the interrupt
            os.write(self._links[worker].fileno(), struct.pack("!i", len(message)))
            os.write(self._links[worker].fileno(), message[: len(message) // 2])
            raise KeyboardInterrupt
        send(self, worker, message)

    GrammarProcesses._send = cut
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params)
    finally:
        GrammarProcesses._send = send
    assert sent[0] >= 12 and not llm.engine.has_unfinished()
    # The old workers are gone; fresh ones wait for a request that needs them (a job
    # stopping on a signal started a set only to stop it).
    assert pool._procs == []
    assert _summary(llm.generate(prompts, params)) == want
    assert len(pool._procs) == 2 and all(p.poll() is None for p in pool._procs)
    llm.engine.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_llm_cut_short_while_sampling_runs_the_next_call_as_a_fresh_one(
    tiny_path,  # noqa: F811
    async_scheduling: bool,
) -> None:
    """The interrupt lands in the sampler: between the runner noting a launch's sampled
    rows and sampling them, which left it refusing every later launch."""
    prompts, params = _prompts(6), [SamplingParams(max_tokens=12, temperature=0)] * 6
    want = _summary(_llm(tiny_path, async_scheduling).generate(prompts, params))
    llm = _llm(tiny_path, async_scheduling)
    runner, calls = llm.engine.runner, [0]
    sample = runner.sampler

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return sample(*args, **kwargs)

    runner.sampler = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    runner.sampler = sample
    assert _summary(llm.generate(prompts, params)) == want


def test_statuses_and_errors_land_on_their_rows_across_workers(tiny_path) -> None:  # noqa: F811
    """Each worker answers only its rows that did not simply take their token, by their
    place in the step: stopped and rejected rows come back where they were sent, with the
    rejected rows' errors, whichever worker holds them."""
    from tokenmill.engine.loader import resolve_model_source
    from tokenmill.engine.structured_output_params import REJECTED, STOPPED

    tokenizer = resolve_model_source(str(tiny_path)).load_tokenizer()
    pool = GrammarProcesses("llguidance", tokenizer, 288, [tokenizer.eos_token_id], 3)
    brace, close = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("{", "}"))
    keys = [pool.matcher("json_object") for _ in range(7)]  # workers 0, 1, 2, 0, 1, 2, 0
    masks = np.zeros((7, 9), np.int32)
    pool.fill(keys, masks)
    tokens = [brace, close, brace, close, brace, brace, close]
    want = [TAKEN, REJECTED, TAKEN, REJECTED, TAKEN, TAKEN, REJECTED]
    assert pool.consume(keys, tokens).tolist() == want
    assert all(pool.error(keys[i]) != pool.error(-1) for i in (1, 3, 6))
    assert pool.error(keys[0]) == pool.error(-1)  # taken: no error of its own
    order = [keys[4], keys[0], keys[2]]  # rows that took "{" get "}", in another order
    pool.fill(order, masks[:3])
    assert pool.consume(order, [close] * 3).tolist() == [STOPPED] * 3
    pool.close()


def test_close_from_another_thread_stops_the_running_call_with_the_closed_error(
    tiny_path,  # noqa: F811
) -> None:
    """close() released the grammar workers under the running step, whose caller got
    'grammar worker process 0 ... stopped' (a crash, it read) instead of the closed error."""
    import threading

    llm = _llm(tiny_path, True, structured_output_processes=2)
    params = SamplingParams(max_tokens=30, temperature=0, structured_output="json_object")
    stepping, raised = threading.Event(), []
    step = llm.engine.step

    def step_and_tell() -> Any:
        stepping.set()
        return step()

    llm.engine.step = step_and_tell  # type: ignore[method-assign]

    def call() -> None:
        try:
            llm.generate([[5, 6, 7 + i % 50] for i in range(400)], params)
        except RuntimeError as exc:
            raised.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    assert stepping.wait(60)
    pool = llm.engine._grammars.backend
    llm.close()
    thread.join(60)
    assert not thread.is_alive()
    assert len(raised) == 1 and "this engine was closed" in str(raised[0]), raised
    assert not pool._procs and not pool._segments


def test_a_forked_child_leaves_its_parents_workers_and_masks_alone(tiny_path) -> None:  # noqa: F811
    """An audit: a forked child that exited ran its copy of the pool's finalizer, stopping
    the parent's grammar workers and removing its shared masks; the parent's next
    constrained call failed ("grammar worker process 0 ... stopped")."""
    llm = _llm(tiny_path, True, structured_output_processes=2)
    params = SamplingParams(max_tokens=8, temperature=0, structured_output="json_object")
    want = _summary(llm.generate(_prompts(3), params))
    pool = llm.engine._grammars.backend
    segments = [shm.name for shm, *_ in pool._segments.values()]
    pid = os.fork()
    if pid == 0:  # the child: drops its copies (finalizers run), then leaves at once
        try:
            del pool, llm
            gc.collect()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert all(os.path.exists(f"/dev/shm/{name}") for name in segments)
    assert all(p.poll() is None for p in llm.engine._grammars.backend._procs)
    assert _summary(llm.generate(_prompts(3), params)) == want
    llm.engine.close()


def test_a_pending_feed_less_dropped_rows_keeps_the_others_token_runs() -> None:
    """A drafted step's feed holds each row's run of tokens: a dropped row's run leaves with
    it, the others' stay whole and in order."""
    from tokenmill.engine.structured_output import _PendingFeed

    rids = np.array(["a", "b", "c"], dtype=object)
    rows = np.array([10, 11, 12], dtype=object)
    feed = _PendingFeed(rids, rows, np.array([1, 2, 3, 4, 5, 6]), np.array([1, 3, 2]))
    left = feed.without({"b"})
    assert left is not None
    assert left.rids.tolist() == ["a", "c"] and left.rows.tolist() == [10, 12]
    assert left.tokens.tolist() == [1, 5, 6] and left.counts.tolist() == [1, 2]
    single = _PendingFeed(rids, rows, np.array([7, 8, 9]), None).without({"a", "c"})
    assert single is not None and single.tokens.tolist() == [8] and single.counts is None
    assert feed.without({"a", "b", "c"}) is None
    assert feed.without({"z"}) is feed
