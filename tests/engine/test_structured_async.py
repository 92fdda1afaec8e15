"""Structured output keeps async scheduling: a step with constrained rows is launched while
the previous one is in flight (its tokens are waited for and fed to the grammars inside the
launch, after the forward pass is enqueued), and every output is the synchronous loop's;
the grammars' batched masks and reused mask buffers give the masks one row at a time gives."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.engine.test_structured_output import TINY_SCHEMA, validate
from tests.tiny_models import EOS_ID, save_tiny_model, save_tiny_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.engine.core.request import Request
from tokenmill.engine.engine_config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.model_runner import PreparedStep
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampler import apply_token_bitmask
from tokenmill.engine.structured_output import StructuredOutputs

BLOCK = 4
CHOICES = ["yes", "no", "maybe so"]
REGEX = "[a-c]{2,6}-[0-9]{1,3}"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("structured_async") / "m")


def _prompts(n: int) -> list[list[int]]:
    return [[(29 * i + 7 * t) % 250 + 5 for t in range(4 + i % 11)] for i in range(n)]


def _params(n: int) -> list[SamplingParams]:
    """Constrained rows of every kind, greedy and seeded, between plain ones with
    penalties, logprobs and stop strings; some end early (a choice, a short max_tokens)."""
    kinds: list[Any] = [
        TINY_SCHEMA,
        None,
        "choice:" + json.dumps(CHOICES),
        "regex:" + REGEX,
        None,
        "json_object",
    ]
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        out.append(
            SamplingParams(
                max_tokens=7 if i % 7 == 3 else 30,  # a constrained row cut by length
                temperature=0 if i % 2 else 0.9,
                seed=i,
                structured_output=kind,
                presence_penalty=0.5 if kind is None else 0.0,
                logprobs=2 if i % 5 == 1 else None,
                stop=['"count"'] if i == 6 else (),  # a stop string inside the JSON
            )
        )
    return out


def _summary(outs: list[RequestOutput]) -> list[tuple]:
    return [
        (
            o.token_ids,
            o.finish_reason,
            o.stop_reason,
            None if o.logprobs is None else [(x.token_id, x.rank) for x in o.logprobs],
        )
        for o in outs
    ]


def _check_valid(outs, params) -> None:
    for out, p in zip(outs, params, strict=True):
        spec = p.structured_output
        if spec is None or out.finish_reason != "stop" or out.stop_reason is not None:
            continue  # unconstrained, cut by length, or by a stop string
        if spec.startswith("choice:"):
            assert out.text in CHOICES, out.text
        elif spec.startswith("regex:"):
            assert re.fullmatch(REGEX, out.text), out.text
        elif spec.startswith('{"type":"object","properties"'):
            validate(out.text, TINY_SCHEMA)


def _llm(path: Path, async_scheduling: bool, **kwargs: Any) -> LLM:
    settings = dict(device="cpu", dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 24)
    return LLM(str(path), async_scheduling=async_scheduling, **{**settings, **kwargs})


def _count_overlapped_grammar_launches(engine: LLMEngine) -> list[int]:
    """Wrap the engine's runner.launch: count the launches with a constrained row that
    started while another step was in flight (the overlap this file is about), the steps
    processed inside a launch (while the next step's masks fill), and the launches of steps
    scheduled and flattened ahead (inside the launch before)."""
    counts = [0, 0, 0]
    launch, process = engine.runner.launch, engine._process
    inside = [False]

    def counting(step, token_bitmask=None, prompt_logits=None):
        sched = step.sched if isinstance(step, PreparedStep) else step
        counts[2] += isinstance(step, PreparedStep)
        constrained = any(r.sampling_params.structured_output for r in sched.requests)
        if constrained and engine._in_flight is not None:
            counts[0] += 1
        inside[0] = True
        try:
            return launch(step, token_bitmask, prompt_logits)
        finally:
            inside[0] = False

    def counting_process(sched, launched):
        counts[1] += inside[0]
        return process(sched, launched)

    engine.runner.launch = counting
    engine._process = counting_process
    return counts


@pytest.mark.parametrize("max_num_seqs", [16, 5], ids=["one-batch", "rows-come-and-go"])
def test_async_overlaps_constrained_steps_and_matches_the_synchronous_loop(
    tiny_path, max_num_seqs: int
) -> None:
    prompts, params = _prompts(12), _params(12)
    sync = _llm(tiny_path, False, max_num_seqs=max_num_seqs)
    want = sync.generate(prompts, params)
    llm = _llm(tiny_path, True, max_num_seqs=max_num_seqs)
    overlapped = _count_overlapped_grammar_launches(llm.engine)
    got = llm.generate(prompts, params)
    assert _summary(got) == _summary(want)
    engine = llm.engine
    assert engine.step_profile()["synchronous_steps"] == 0  # never fell back to sync
    assert overlapped[0] > 5
    assert overlapped[1] > 5  # steps processed while the next one's masks filled
    assert overlapped[2] > 5  # steps launched as flattened while the masks before filled
    assert sync.engine.step_profile()["synchronous_steps"] > 0
    finished = {o.finish_reason for o, p in zip(got, params, strict=True) if p.structured_output}
    assert finished == {"stop", "length"}  # both ways of ending mid-overlap are covered
    for out, p in zip(got, params, strict=True):
        if p.structured_output is None:
            continue
        if out.finish_reason != "stop" or out.stop_reason is not None:
            continue  # cut by length, or by the stop string
        if p.structured_output.startswith("choice:"):
            assert out.text in CHOICES
        elif p.structured_output.startswith("regex:"):
            assert re.fullmatch(REGEX, out.text), out.text
        elif p.structured_output.startswith('{"type":"object","properties"'):
            validate(out.text, TINY_SCHEMA)
    assert len(engine._grammars) == 0 and not engine.has_unfinished()
    stats = engine.step_profile()["structured_output"]
    assert stats["mask_calls"] > 0 and stats["feed_calls"] > 0
    worker = engine._grammars._worker
    assert worker is not None  # it processed steps beside the fills
    engine.close()
    assert engine._grammars._worker is None and worker._shutdown


def test_an_abort_while_its_steps_are_in_flight_and_ahead_leaves_the_others_be(tiny_path) -> None:
    prompts, params = _prompts(4), _params(4)
    want = _summary(_llm(tiny_path, False).generate(prompts, params))
    engine = _llm(tiny_path, True).engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    outs: dict[str, RequestOutput] = {}
    for _ in range(4):
        outs.update((o.request_id, o) for o in engine.step())
    assert engine._in_flight is not None  # r0's row is in the step in flight
    assert "r0" in {r.request_id for r in engine._in_flight[0].requests}
    assert engine._ahead is not None  # and in the step scheduled ahead: its row there
    assert "r0" in {r.request_id for r in engine._ahead[0].requests}  # masks allow all
    engine.abort_requests(["r0"])
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert "r0" not in outs
    assert [_summary([outs[f"r{i}"]])[0] for i in range(1, 4)] == want[1:]
    assert len(engine._grammars) == 0


def test_an_aborted_requests_id_added_again_at_once_gets_its_own_grammar(tiny_path) -> None:
    """A retry: a constrained request aborted while its step is in flight and one scheduled
    ahead, and its id added again before the next step. The step in flight's token was the
    aborted request's: fed to the new one's grammar it raised (no mask asked for it)."""
    config = EngineConfig(model=str(tiny_path), device="cpu", dtype="float32", block_size=BLOCK,
                          kv_cache_memory=1 << 24, async_scheduling=True)  # fmt: skip
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=40, temperature=0, structured_output=TINY_SCHEMA)
    engine.add_request("x", [5, 6, 7, 8], params)
    engine.add_request("y", [9, 10, 11], params)
    done: dict[str, RequestOutput] = {}
    for _ in range(3):
        done.update((o.request_id, o) for o in engine.step())
    assert engine._in_flight is not None and engine._ahead is not None and not done
    engine.abort_requests(["x"])
    engine.add_request("x", [5, 6, 7, 8], params)
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    engine.close()
    assert done["x"].finish_reason == "stop" and done["y"].finish_reason == "stop"
    validate(done["x"].text, TINY_SCHEMA)
    validate(done["y"].text, TINY_SCHEMA)


def test_lexer_groups_give_the_outputs_of_one(tiny_path, monkeypatch) -> None:
    """Each constraint compiled once per executor thread, requests spread over the copies
    and a step's rows sorted by copy: every output is the one-group run's, and each mask
    still lands in its own row (rows of mixed groups and kinds in one step)."""
    prompts, params = _prompts(12), _params(12)
    want = _summary(_llm(tiny_path, True, max_num_seqs=5).generate(prompts, params))
    monkeypatch.setattr("tokenmill.engine.grammar_llguidance.executor_threads", lambda: 3)
    llm = _llm(tiny_path, True, max_num_seqs=5)
    grammars = llm.engine._grammars
    groups: list[int] = []
    add = grammars.add

    def recording_add(request: Request) -> None:
        add(request)
        groups.append(grammars._rows[grammars._index[request.request_id]][1])  # (matcher, group)

    monkeypatch.setattr(grammars, "add", recording_add)
    assert _summary(llm.generate(prompts, params)) == want
    assert grammars.backend.num_groups == 3 and set(groups) == {0, 1, 2}
    assert all(len(fresh) == 3 for fresh in grammars.backend.fresh.values())


# ---- the grammars' masks, without a model ---------------------------------------------------


@pytest.fixture(scope="module")
def grammars(tmp_path_factory) -> StructuredOutputs:
    tokenizer = save_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return StructuredOutputs(tokenizer, vocab_size=288, eos_token_ids=[EOS_ID])


def test_one_batched_fill_gives_each_row_its_own_mask_and_buffers_do_not_alias(grammars):
    """Rows at different points of different grammars, filled in one call, get what one-row
    fills give; a mask handed out survives the next fill (its upload may still be pending)."""
    tokenizer = grammars.backend._tokenizer
    specs = [TINY_SCHEMA, "json_object", 'choice:["yes","no"]', "regex:[0-9]+x"]
    texts = ['{"label":"c', "{", "y", "12"]

    def advanced(prefix: str) -> list[Request]:
        requests = []
        for i, (spec, text) in enumerate(zip(specs, texts, strict=True)):
            req = Request(f"{prefix}{i}", [5], SamplingParams(structured_output=spec), (EOS_ID,))
            grammars.add(req)
            for token in tokenizer.encode(text, add_special_tokens=False):
                grammars.bitmask([req])
                grammars.feed([req], [token])
            requests.append(req)
        return requests

    alone = np.concatenate([grammars.bitmask([req]).copy() for req in advanced("a")])
    batch = advanced("b")
    together = grammars.bitmask(batch)
    assert np.array_equal(together, alone)
    assert len({tuple(row) for row in alone.tolist()}) == len(specs)  # four different masks
    kept = together.copy()
    grammars.feed(batch, [int(np.flatnonzero(_bits(row))[0]) for row in kept])
    following = grammars.bitmask(batch[:2])
    assert not np.shares_memory(together, following)
    assert np.array_equal(together, kept)  # the next fill wrote elsewhere
    grammars.drop([f"{p}{i}" for p in "ab" for i in range(len(specs))])
    assert len(grammars) == 0


def _bits(row: np.ndarray) -> np.ndarray:
    return np.unpackbits(row.view(np.uint8), bitorder="little")


@pytest.mark.parametrize("words", [2, 4], ids=["mask-shorter-than-vocab", "mask-longer"])
def test_apply_token_bitmask_in_any_row_order(words: int) -> None:
    vocab, gen = 100, torch.Generator().manual_seed(3)
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int32)
    rows = torch.tensor([4, 0, 2])  # not sorted
    out = apply_token_bitmask(logits, rows, bitmask)
    want = logits.clone()
    for g, row in enumerate(rows.tolist()):
        bits = _bits(bitmask[g].numpy())
        for t in range(vocab):
            if t >= len(bits) or not bits[t]:
                want[row, t] = float("-inf")
    assert torch.equal(out, want)
    assert torch.equal(out[[1, 3]], logits[[1, 3]])  # rows without a grammar untouched


@pytest.mark.parametrize("plain_rows", [False, True])
def test_kept_sampling_metadata_takes_each_steps_masks(
    tiny_path, monkeypatch, plain_rows: bool
) -> None:
    """Constrained rows keep their sampling metadata between steps like any (sampling_reuse):
    only the masks are the step's own. Rows of every kind that sample alike (the widest
    kept metadata's first rows, as rows end at different steps), and constrained rows
    between plain ones (the same rows' metadata): what rebuilding it every step gives."""
    from tests.engine.test_sampling_reuse import reused_and_rebuilt

    kinds = [TINY_SCHEMA, "choice:" + json.dumps(CHOICES), "regex:" + REGEX, "json_object"]
    if plain_rows:
        kinds.insert(1, None)
    params = [
        SamplingParams(max_tokens=9 + 3 * i, temperature=0, structured_output=kinds[i % len(kinds)])
        for i in range(10)
    ]
    prompts = _prompts(10)

    (reused, reused_builds), (rebuilt, rebuilt_builds) = reused_and_rebuilt(
        monkeypatch, lambda: _llm(tiny_path, True, max_num_seqs=4).generate(prompts, params)
    )
    assert _summary(reused) == _summary(rebuilt)
    assert reused_builds < rebuilt_builds / 2
    assert {o.finish_reason for o in reused} == {"stop", "length"}
    _check_valid(reused, params)


@pytest.mark.parametrize(
    "aborted, waiting",
    [(["json"], False), (["json"], True), (["json", "free"], False)],
    ids=["the-only-grammar", "another-grammar-waits", "every-request"],
)
def test_aborting_every_constrained_row_of_the_step_ahead(
    tiny_path, aborted: list[str], waiting: bool
) -> None:
    """The step scheduled ahead holds only aborted constrained rows: it is launched with
    their masks allowing every token (the engine once launched it with no masks, or asked
    the grammar library for zero rows' masks), and the engine goes on: the others finish as
    in a fresh engine, and a drained engine takes new work."""
    plain = SamplingParams(max_tokens=12, temperature=0)
    constrained = SamplingParams(max_tokens=12, temperature=0, structured_output="json_object")
    want = _llm(tiny_path, False).generate([[5, 6, 7, 8], [12, 13, 14]], [plain, constrained])
    engine = _llm(tiny_path, True, max_num_seqs=2).engine
    engine.add_request("free", [5, 6, 7, 8], plain)
    engine.add_request("json", [9, 10, 11], constrained)
    if waiting:  # a second grammar, waiting for a row: the masks are asked for
        engine.add_request("json2", [12, 13, 14], constrained)
    outs: dict[str, RequestOutput] = {}
    for _ in range(2):
        outs.update((o.request_id, o) for o in engine.step())
    assert engine._ahead is not None
    assert "json" in {r.request_id for r in engine._ahead[0].requests}
    engine.abort_requests(aborted)
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert not set(aborted) & set(outs)
    expected = {"free": want[0], "json2": want[1]}
    for rid, out in outs.items():
        assert out.token_ids == expected[rid].token_ids
    assert len(engine._grammars) == 0
    engine.add_request("after", [1, 2, 3], plain)
    after = []
    while engine.has_unfinished():
        after += engine.step()
    assert [o.request_id for o in after] == ["after"]
    engine.close()


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_request_taking_a_slot_during_a_fill_is_sampled_with_its_own_settings(
    tiny_path,  # noqa: F811
    backend: str,
) -> None:
    """One batch slot: A's grammar ends it on its 2nd token (min_tokens 2 rebuilt its
    sampling settings that step), and B takes A's slot while that step's masks fill. The
    settings built for A were kept as B's: a plain B failed the call ("0 rows have
    structured_output but no token_bitmask..."), a constrained B sampling at temperature 1
    was sampled greedily, as A. Async scheduling now gives the synchronous loop's outputs."""
    if backend == "xgrammar":
        pytest.importorskip("xgrammar")
    first = SamplingParams(
        max_tokens=20, temperature=0, min_tokens=2, structured_output="regex:[0-9]{2}"
    )
    seconds = [
        SamplingParams(max_tokens=5, temperature=0),
        SamplingParams(max_tokens=8, temperature=1.0, seed=7, structured_output="regex:[a-z]{1,8}"),
    ]
    kwargs = dict(max_num_seqs=1, structured_output_backend=backend)
    for second in seconds:
        prompts, params = [[5, 6, 7, 8], [9, 10, 11]], [first, second]
        want = _llm(tiny_path, False, **kwargs).generate(prompts, params)
        got = _llm(tiny_path, True, **kwargs).generate(prompts, params)
        assert _summary(got) == _summary(want)


def test_a_rejected_tokens_error_is_llguidances_error_line_alone(tiny_path) -> None:  # noqa: F811
    """A grammar that allows only EOS where min_tokens bans it: the row samples a token the
    grammar rejects and ends "error". The error names the parser's complaint in one line,
    without the parser state and timings llguidance appends (which differed between runs,
    so the same job's error rows differed)."""
    params = [
        SamplingParams(max_tokens=8, temperature=0, min_tokens=3, structured_output='choice:[""]')
    ]
    errors = set()
    for async_scheduling in (False, True):
        out = _llm(tiny_path, async_scheduling).generate([[5, 6, 7, 8]], params)[0]
        assert out.finish_reason == "error"
        errors.add(out.error)
    (error,) = errors
    assert "doesn't satisfy the grammar" in error and "\n" not in error
    assert "compute_time_us" not in error and "<state>" not in error
