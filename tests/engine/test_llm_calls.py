"""LLM calls as services make them: from several threads at once (one after another, each
getting its own outputs), and cut short by Ctrl-C (the call's requests go; the next call
runs as on a fresh engine)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_model
from tokenmill import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("calls") / "m")


def _prompts(seed: int) -> list[list[int]]:
    return [[(seed * 31 + 7 * i + t) % 250 + 5 for t in range(6 + i)] for i in range(10)]


def test_calls_from_two_threads_each_get_their_own_outputs(model: Path) -> None:
    """Two threads' step loops on one engine took each other's outputs (wrong completions,
    KeyErrors, and then a runner that could not launch again)."""
    llm = LLM(str(model), device="cpu", dtype="float32", max_num_seqs=4)
    want = {k: [o.token_ids for o in llm.generate(_prompts(k), PARAMS)] for k in (1, 2)}
    got: dict[int, list] = {1: [], 2: []}
    errors: list[BaseException] = []

    def calls(k: int) -> None:
        try:
            for _ in range(3):
                got[k].append([o.token_ids for o in llm.generate(_prompts(k), PARAMS)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=calls, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert got == {k: [want[k]] * 3 for k in (1, 2)}


def test_a_call_cut_short_leaves_the_engine_as_new(model: Path, monkeypatch) -> None:
    """Ctrl-C in the middle of generate left its requests in the engine: later calls ran
    them too, or failed ("the KV cache is too small for the waiting prompt")."""
    llm = LLM(str(model), device="cpu", dtype="float32", max_num_seqs=4, kv_cache_memory=1 << 20)
    want = [o.token_ids for o in llm.generate(_prompts(3), PARAMS)]
    step, steps = llm.engine.step, []

    def interrupted():
        steps.append(1)
        if len(steps) == 5:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(_prompts(3), PARAMS)
    assert not llm.engine.scheduler.has_unfinished()  # the cut call's requests are gone
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(_prompts(3), PARAMS)] == want
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.runner.num_blocks


@pytest.mark.parametrize("ahead", [False, True])
def test_a_cut_call_leaves_no_cached_block_without_its_kv(
    model: Path, monkeypatch, ahead: bool
) -> None:
    """A prompt's full blocks enter the prefix cache when its step is scheduled. Ctrl-C
    inside that step's forward pass (or, with async scheduling and a grammar, between two
    steps while the next one is scheduled ahead) left them cached with no KV written: the
    retry on the same LLM hit them (num_cached_tokens 36 of 40) and gave other tokens."""
    prompts = [[(37 * p + 11 * t) % 250 + 5 for t in range(40)] for p in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    settings = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=4)
    if ahead:
        params = SamplingParams(
            max_tokens=6, temperature=0, structured_output={"regex": "[a-z]{4,9}"}
        )
        settings["async_scheduling"] = True
    want = [
        o.token_ids
        for o in LLM(str(model), **settings, enable_prefix_caching=False).generate(prompts, params)
    ]
    llm = LLM(str(model), **settings)
    engine = llm.engine
    if ahead:
        step = engine.step

        def cut_between_steps():
            out = step()
            if engine._ahead is not None:  # a step scheduled ahead, its blocks cached
                raise KeyboardInterrupt
            return out

        monkeypatch.setattr(engine, "step", cut_between_steps)
    else:
        attention = engine.runner.model.model.layers[1].self_attn
        monkeypatch.setattr(attention, "forward", _raises(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    monkeypatch.undo()
    retry = llm.generate(prompts, params)
    assert [o.num_cached_tokens for o in retry] == [0] * len(prompts)
    assert [o.token_ids for o in retry] == want
    again = llm.generate(prompts, params)  # what the retry computed is cached as usual
    assert all(o.num_cached_tokens > 0 for o in again)
    assert [o.token_ids for o in again] == want


def _raises(exc: type[BaseException]):
    def forward(*args, **kwargs):
        raise exc

    return forward


def _nth_call_raises(monkeypatch, owner: object, name: str, n: int) -> None:
    """``owner.name`` raises KeyboardInterrupt on its ``n``-th call (Ctrl-C landing there)."""
    real, calls = getattr(owner, name), [0]

    def cut(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, cut)


@pytest.mark.parametrize(
    "where",
    [
        "second-ctrl-c-in-cleanup",
        "second-ctrl-c-in-settle",
        "admitting",
        "retiring",
        "adding-a-group",
        "tracking",
    ],
)
def test_an_interrupt_anywhere_in_a_call_leaves_the_llm_as_new(
    model: Path, monkeypatch, where: str
) -> None:
    """Ctrl-C landing outside the forward pass left state cut_short could not see: a second
    Ctrl-C during its cleanup skipped the prefix-cache reset (wrong tokens on every later
    call); one while the scheduler admitted or retired requests left batch slots and KV
    blocks held by no request ("all 4 batch slots are taken" on every later call); one
    between an n=2 prompt's requests left the first in the engine, unaborted; one inside
    add_request left a scheduled request the engine did not track (KeyError later)."""
    import tokenmill.engine.llm_engine as llm_engine

    prompts = [[(37 * p + 11 * t) % 250 + 5 for t in range(40)] for p in range(6)]
    n = 2 if where == "adding-a-group" else 1
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=n, stop=["zzz"])
    settings = dict(device="cpu", dtype="float32", block_size=4, max_num_seqs=4)
    if where == "second-ctrl-c-in-cleanup":
        settings["async_scheduling"] = True
    plain = LLM(str(model), **settings, enable_prefix_caching=False)
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params)]
    llm = LLM(str(model), **settings)
    engine = llm.engine
    kv = engine.scheduler.kv
    if where == "second-ctrl-c-in-cleanup":
        attention = engine.runner.model.model.layers[1].self_attn
        monkeypatch.setattr(attention, "forward", _raises(KeyboardInterrupt))
        collect = engine._outputs.collect

        def collect_cut(wait: bool = False):
            if wait:  # cut_short waits for the output worker: Ctrl-C again
                raise KeyboardInterrupt
            return collect(wait)

        monkeypatch.setattr(engine._outputs, "collect", collect_cut)
    elif where == "second-ctrl-c-in-settle":  # the wait for the grammars' worker thread
        attention = engine.runner.model.model.layers[1].self_attn
        monkeypatch.setattr(attention, "forward", _raises(KeyboardInterrupt))
        _nth_call_raises(monkeypatch, engine._grammars, "settle", 1)
    elif where == "admitting":
        _nth_call_raises(monkeypatch, kv, "cache_blocks", 2)
    elif where == "retiring":
        _nth_call_raises(monkeypatch, kv, "free", 1)
    elif where == "adding-a-group":
        _nth_call_raises(monkeypatch, engine, "add_request", 4)
    else:
        _nth_call_raises(monkeypatch, llm_engine, "IncrementalDetokenizer", 3)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    monkeypatch.undo()
    assert not engine.has_unfinished() and not engine._tracked
    assert engine.scheduler.slots.num_free == 4
    assert engine.scheduler.kv.num_free_blocks == engine.runner.num_blocks
    for _ in range(2):  # the second call hits what the first cached
        outs = llm.generate(prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in outs] == want


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_that_raised_is_named_by_the_next_until_cut_short(
    model: Path, monkeypatch, async_scheduling: bool
) -> None:
    """LLMEngine driven directly, its forward pass failing once (a CUDA OOM, say): each later
    step raised an error naming another cause ("the KV cache is too small for the waiting
    prompt" synchronously, a request's "pending input token was not sampled" async). Now
    they name the first error and the way out, which runs the same ids as a fresh engine."""
    llm = LLM(str(model), device="cpu", dtype="float32", async_scheduling=async_scheduling)
    engine, prompts = llm.engine, _prompts(3)[:4]
    ids = [f"r{i}" for i in range(len(prompts))]

    def run() -> dict[str, list[int]]:
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, prompt, PARAMS)
        outs: dict[str, list[int]] = {}
        while engine.has_unfinished():
            outs.update((o.request_id, o.token_ids) for o in engine.step())
        return outs

    want = run()
    forward = engine.runner.model.forward
    calls = [0]

    def fails_once(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("out of memory (injected)")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", fails_once)
    with pytest.raises(MemoryError):
        run()
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"earlier LLMEngine.step raised \(MemoryError: "):
            engine.step()
    engine.cut_short(ids)
    assert run() == want
    llm.close()


def test_add_request_without_sampling_params_names_the_argument(model: Path) -> None:
    """params=None raised "'NoneType' object has no attribute 'num_samples'" (vLLM's
    add_request takes no default either); the engine runs on after the refusal."""
    with LLM(str(model), device="cpu", dtype="float32") as llm:
        engine = llm.engine
        for params in (None, {"max_tokens": 4}):
            with pytest.raises(TypeError, match=r"params must be a SamplingParams, got "):
                engine.add_request("x", [5, 6, 7], params)  # type: ignore[arg-type]
        assert not engine.has_unfinished()
        engine.add_request("x", [5, 6, 7], PARAMS)  # the id was not taken
        outs = [o for _ in range(20) if engine.has_unfinished() for o in engine.step()]
        assert [len(o.token_ids) for o in outs] == [PARAMS.max_tokens]


def test_aborting_after_close_releases_without_raising(model: Path) -> None:
    """A closed engine refuses requests and steps, but an abort still releases: the call
    LLM.close stops in another thread aborts its requests after the close (cut_short), as
    cleanup code after a close in a finally block does; raising there would hide the
    error that stopped it."""
    llm = LLM(str(model), device="cpu", dtype="float32")
    engine = llm.engine
    engine.add_request("x", [5, 6, 7], PARAMS)
    engine.step()
    llm.close()
    engine.abort_requests(["x", "never added"])
    assert not engine.scheduler.has_unfinished() and not engine.unfinished_output_tokens()
    with pytest.raises(RuntimeError, match="this engine was closed"):
        engine.step()
