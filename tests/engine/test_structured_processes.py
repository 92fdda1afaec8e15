"""Grammars in worker processes (``structured_output_processes``): the same outputs as the
grammars in the engine's process, on both libraries, with async scheduling; a constraint
the library rejects is refused when the request is added; a worker that dies stops the
engine with an error naming it; close() ends the workers."""

from __future__ import annotations

import gc
import os
import signal

import pytest

from tests.engine.test_structured_async import (
    _llm,
    _params,
    _prompts,
    _summary,
    tiny_path,  # noqa: F401  (the module's tiny model fixture)
)
from tests.engine.test_structured_xgrammar import _check_valid
from tokenmill import SamplingParams
from tokenmill.engine.engine_config import EngineConfig
from tokenmill.engine.grammar_processes import GrammarProcesses


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
    assert len(grammars) == 0 and llm.engine.step_profile()["synchronous_steps"] == 0
    procs = list(pool._procs)
    assert len(procs) == 2 and all(p.poll() is None for p in procs)
    llm.engine.close()
    assert all(p.poll() is not None for p in procs)
    assert pool._shm is None


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


def test_a_dead_worker_stops_the_engine_naming_it(tiny_path) -> None:  # noqa: F811
    llm = _llm(tiny_path, True, structured_output_processes=2)
    params = SamplingParams(max_tokens=30, temperature=0, structured_output="json_object")
    for i, prompt in enumerate(_prompts(4)):
        llm.engine.add_request(f"r{i}", prompt, params)
    llm.engine.step()
    victim = llm.engine._grammars.backend._procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    with pytest.raises(RuntimeError, match=rf"grammar worker process 1 \(pid {victim.pid}\)"):
        while llm.engine.has_unfinished():
            llm.engine.step()
    llm.engine.close()


def test_a_negative_process_count_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="structured_output_processes"):
        EngineConfig(model="m", structured_output_processes=-1)


def test_workers_of_a_pool_never_closed_stop_when_it_is_collected(tiny_path) -> None:  # noqa: F811
    from tokenmill.engine.loader import resolve_model_source

    tokenizer = resolve_model_source(str(tiny_path)).load_tokenizer()
    pool = GrammarProcesses("llguidance", tokenizer, 288, [tokenizer.eos_token_id], 2)
    key, _ = pool.matcher("json_object")
    assert pool.consume([(key, 0)], [tokenizer.encode("{", add_special_tokens=False)[0]]) == [True]
    procs = list(pool._procs)
    del pool
    gc.collect()
    assert all(p.poll() is not None for p in procs)
