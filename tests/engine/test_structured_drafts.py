"""Constrained rows take draft tokens (grammar_drafts.py): each drafted position's logits are
masked by the grammar in the state its drafts lead to, the kept tokens are fed in turn,
and every output is the one token-by-token decoding gives, whatever the drafts: true ones
(accepted), wrong ones (rejected), drafted ahead of a step in flight or not, with the
grammars in this process or in worker processes, with either grammar library."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.engine.test_multi_token_steps import AheadProposer, ContinuationProposer
from tests.engine.test_structured_async import _check_valid, _params, _prompts
from tests.tiny_models import EOS_ID, save_tiny_model, save_tiny_tokenizer
from tokenmill import SamplingParams
from tokenmill.engine.engine_config import EngineConfig, SpeculativeConfig
from tokenmill.engine.grammar_drafts import consume_runs, fill_with_drafts
from tokenmill.engine.grammar_llguidance import LlguidanceGrammars
from tokenmill.engine.grammar_xgrammar import XgrammarGrammars
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.structured_output_params import (
    DROPPED,
    STOPPED,
    TAKEN,
    check_structured_output,
)

N = 12


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("structured_drafts") / "m")


def _run(
    path: Path,
    params: list[SamplingParams],
    proposer=None,
    async_scheduling: bool = True,
    backend: str = "llguidance",
    processes: int = 0,
) -> tuple[dict[str, RequestOutput], LLMEngine]:
    config = EngineConfig(
        model=str(path),
        device="cpu",
        dtype="float32",
        block_size=4,
        kv_cache_memory=1 << 24,
        max_num_seqs=5,  # rows come and go
        async_scheduling=async_scheduling,
        structured_output_backend=backend,
        structured_output_processes=processes,
        profile_steps=True,
    )
    engine = LLMEngine(config, proposer)
    for i, (prompt, p) in enumerate(zip(_prompts(len(params)), params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    assert len(engine._grammars) == 0
    assert engine.scheduler.kv.num_free_blocks == engine.runner.num_blocks
    return done, engine


def _summary(outs: dict[str, RequestOutput]) -> dict[str, tuple]:
    return {
        rid: (o.token_ids, o.text, o.finish_reason, o.stop_reason)
        for rid, o in sorted(outs.items())
    }


# Every kind of drafts with the default grammars (llguidance, in process); the others (the
# other library, worker processes) with the kinds that walk the most (some rows accepting
# some drafts) and the synchronous path.
CASES = [
    *(("llguidance", 0, drafts) for drafts in ("true-ahead", "flaky-ahead", "true-sync")),
    ("llguidance", 0, "wrong-ahead"),
    ("xgrammar", 0, "flaky-ahead"),
    ("xgrammar", 0, "true-sync"),
    ("xgrammar", 2, "flaky-ahead"),
    ("llguidance", 2, "true-sync"),
]


@pytest.mark.parametrize(("backend", "processes", "drafts"), CASES)
def test_drafted_constrained_rows_give_token_by_token_outputs(
    tiny_path, backend: str, processes: int, drafts: str
) -> None:
    params = _params(N)
    want, _ = _run(tiny_path, params, backend=backend, processes=processes)
    outputs = {rid: list(o.token_ids) for rid, o in want.items()}
    if drafts == "true-sync":
        proposer = ContinuationProposer(outputs, 3)
    else:
        proposer = AheadProposer(
            outputs, 3, wrong=drafts == "wrong-ahead", flaky=drafts == "flaky-ahead"
        )
    got, engine = _run(tiny_path, params, proposer, backend=backend, processes=processes)
    assert _summary(got) == _summary(want)
    _check_valid([got[f"r{i}"] for i in range(N)], params)
    walked = engine._grammars.stats.drafts_walked
    assert walked > 10  # constrained rows took drafts
    accepted = engine.scheduler.stats.num_accepted_tokens
    assert (accepted == 0) == (drafts == "wrong-ahead")


def test_a_grammar_ended_inside_a_drafted_step_cuts_the_tokens_after_it(tiny_path) -> None:
    """A choice completed by an accepted draft, with the stop token drafted and accepted
    after it: the output ends where the grammar did, as without drafts, and the drafts cut
    are not counted as accepted."""
    params = [
        SamplingParams(max_tokens=12, temperature=0, structured_output='choice:["x", "xy"]')
    ] * 3
    want, _ = _run(tiny_path, params)
    assert any(o.token_ids[-1] != EOS_ID for o in want.values())  # ended by the grammar
    outputs = {rid: [*o.token_ids, EOS_ID, EOS_ID, EOS_ID] for rid, o in want.items()}
    got, engine = _run(tiny_path, params, ContinuationProposer(outputs, 3), False)
    assert _summary(got) == _summary(want)
    assert engine._grammars.stats.drafts_walked > 0
    # a row's first token is its prompt step's, its second the drafted step's own sample:
    # only the tokens after them can be accepted drafts (all of them, with these drafts)
    drafted = sum(max(len(o.token_ids) - 2, 0) for o in got.values())
    assert engine.scheduler.stats.num_accepted_tokens == drafted


@pytest.mark.parametrize("backend", [LlguidanceGrammars, XgrammarGrammars])
def test_walking_drafts_fills_the_masks_one_token_at_a_time_would(backend) -> None:
    """fill_with_drafts against masks filled after consuming each draft for real, for
    drafts the grammar takes, one it refuses midway, and a stop token; and the matchers are
    left as they were (a fill afterwards equals the first mask)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = save_tiny_tokenizer(tmp)
    grammars = backend(tokenizer, 261, [EOS_ID])
    spec = check_structured_output('choice:["abcd", "abx"]')
    ids = tokenizer.convert_tokens_to_ids
    a, b, c, d, x = (ids(ch) for ch in "abcdx")
    rows = [grammars.matcher(spec) for _ in range(3)]
    drafts = [[a, b, c], [a, x, c], [a, EOS_ID]]  # all taken; refused at x; a stop token
    counts = np.array([3, 3, 2])
    words = -(-261 // 32)
    mask = np.zeros((sum(counts) + 3, words), dtype=np.int32)
    places = np.array([0, 4, 8])
    fill_with_drafts(grammars, rows, mask, places, np.concatenate(drafts), counts)
    for i, row in enumerate(rows):
        fresh = grammars.matcher(spec)
        one = np.zeros((1, words), dtype=np.int32)
        expected = []
        refused = False
        for j in range(counts[i] + 1):
            if not refused:
                grammars.fill([fresh], one)
                last = one.copy()
            expected.append(last[0])
            if j < counts[i] and not refused:
                token = drafts[i][j]
                refused = token == EOS_ID or grammars.consume([fresh], [token])[0] != TAKEN
        np.testing.assert_array_equal(mask[places[i] : places[i] + counts[i] + 1], expected)
        again = np.zeros((1, words), dtype=np.int32)
        grammars.fill([row], again)
        np.testing.assert_array_equal(again[0], mask[places[i]])  # rolled back
    tokens = [a, b, x, a, b, c, d, EOS_ID, a, b, c]
    status, took = consume_runs(grammars, rows, tokens, np.array([3, 5, 3]))
    assert took.tolist() == [3, 4, 3]  # the second stops at "abcd": its EOS is not taken
    assert status.tolist() == [STOPPED, STOPPED, TAKEN]


def test_masks_after_drafts_are_left_open_where_the_argmax_decides() -> None:
    """With ``open_rows``, a position after a taken draft gets the open mask (every token
    but EOS) instead of a fill, except where the grammar could end there, and the position
    before a refused draft is filled (its sample must not be that draft); a last token
    sampled at an open position is taken if the grammar allows it, else DROPPED with the
    matcher left where it was."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = save_tiny_tokenizer(tmp)
    grammars = LlguidanceGrammars(tokenizer, 261, [EOS_ID])
    spec = check_structured_output('choice:["abcd", "abx"]')
    a, b, c, d, x, q = (tokenizer.convert_tokens_to_ids(ch) for ch in "abcdxq")
    rows = [grammars.matcher(spec) for _ in range(4)]
    # all taken; refused at x; "abx" complete at 3 (EOS allowed there); a stop token
    drafts = [[a, b, c], [a, x, c], [a, b, x], [a, EOS_ID]]
    counts = np.array([3, 3, 3, 2])
    words = -(-261 // 32)
    places = np.array([0, 4, 8, 12])
    mask = np.zeros((15, words), dtype=np.int32)
    opened = fill_with_drafts(
        grammars, rows, mask, places, np.concatenate(drafts), counts, np.ones(4, dtype=bool)
    )
    assert opened.tolist() == [0b1110, 0, 0b0110, 0]
    full = np.zeros((15, words), dtype=np.int32)
    fill_with_drafts(grammars, rows, full, places, np.concatenate(drafts), counts)
    open_row = grammars.open_mask()
    bits = np.unpackbits(open_row.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits == 0).tolist() == [EOS_ID, *range(261, 32 * words)]
    for i in range(4):
        for j in range(counts[i] + 1):
            at = places[i] + j
            want = open_row if (opened[i] >> j) & 1 else full[at]
            np.testing.assert_array_equal(mask[at], want, err_msg=f"row {i} position {j}")
    try_last = np.array([True, False, True, False])
    tokens = [a, b, q, a, a, b, x, a]
    status, took = consume_runs(grammars, rows, tokens, np.array([3, 1, 3, 1]), try_last)
    assert status.tolist() == [DROPPED, TAKEN, STOPPED, TAKEN]
    assert took.tolist() == [2, 1, 3, 1]
    assert grammars.consume([rows[0]], [c]).tolist() == [TAKEN]  # still after "ab"


def test_masks_left_open_keep_token_by_token_outputs(tiny_path) -> None:
    """Synchronous drafted steps of true drafts with the masks after drafts left open
    (llguidance, in this process and in workers): the outputs are those of no drafts and
    of every mask filled, and the tiny model's favourite token, mostly one its grammar
    refuses, is dropped where it was sampled at an open position."""
    params = _params(N)
    want, _ = _run(tiny_path, params)
    outputs = {rid: list(o.token_ids) for rid, o in want.items()}
    for processes in (0, 2):
        got, engine = _run(tiny_path, params, ContinuationProposer(outputs, 3), False,
                           processes=processes)  # fmt: skip
        assert _summary(got) == _summary(want)
        assert engine._grammars.stats.tokens_dropped > 0
        _check_valid([got[f"r{i}"] for i in range(N)], params)


def test_a_grammar_cut_inside_a_drafted_step_leaves_no_cut_token_in_a_watched_text(
    tiny_path,
) -> None:
    """A row with stop strings decodes its tokens as they come (its detokenizer): the
    tokens kept after its grammar's end (EOS, not a stop token with ignore_eos, and spelled
    out) are cut from its text too, not from its token ids alone."""
    params = [
        SamplingParams(
            max_tokens=12,
            temperature=0,
            structured_output='choice:["x", "xy"]',
            ignore_eos=True,
            skip_special_tokens=False,
            stop=["zzz"],
        )
    ] * 3
    want, _ = _run(tiny_path, params)
    outputs = {rid: [*o.token_ids, EOS_ID, EOS_ID, EOS_ID] for rid, o in want.items()}
    got, engine = _run(tiny_path, params, ContinuationProposer(outputs, 3), False)
    assert _summary(got) == _summary(want)
    assert engine._grammars.stats.drafts_walked > 0
    drafted = sum(max(len(o.token_ids) - 2, 0) for o in got.values())  # as the test above
    assert engine.scheduler.stats.num_accepted_tokens == drafted


@pytest.mark.parametrize("processes", [0, 2])
def test_a_token_the_grammar_rejects_after_a_stop_string_leaves_the_stop(
    tiny_path, processes: int
) -> None:
    """xgrammar lets a surrogate half written over two tokens through its mask, and its
    grammar rejects the second token: an error. Drafted in the step whose first token
    completes a stop string, the request still stops there, as token by token, where those
    tokens are never sampled."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = save_tiny_tokenizer(tmp)
    grammars = XgrammarGrammars(tokenizer, 261, [EOS_ID], threads=1)
    grammars.matcher('{"type":"string"}')  # (loads the token tables)
    lead, tail = int(np.flatnonzero(grammars._ends_lead)[0]), grammars._continues.index(1)
    schema = '{"type":"object","properties":{"a":{"type":"string"}},"required":["a"]}'
    params = [
        SamplingParams(
            max_tokens=12,
            temperature=0,
            structured_output=schema,
            logit_bias={lead: 100.0, tail: 50.0},  # '{"a":"' (forced), then the two halves
            stop=[':"'],
        )
    ]
    want, _ = _run(tiny_path, params, backend="xgrammar", processes=processes)
    assert (want["r0"].finish_reason, want["r0"].stop_reason) == ("stop", ':"')
    outputs = {"r0": [*want["r0"].token_ids, lead, tail]}
    got, engine = _run(
        tiny_path, params, ContinuationProposer(outputs, 3), False, "xgrammar", processes
    )
    assert _summary(got) == _summary(want)
    assert got["r0"].error is None
    assert engine.scheduler.stats.num_draft_tokens > 0


class _AlwaysDraft:
    """A speculation policy that wants drafts on every step it is asked about."""

    def wants_drafts(self, batch: int, slowest_yield: float | None = None) -> bool:
        return True

    def record(self, sample) -> None:
        pass

    def charge_switch_back(self, batch: int, wall_ms: float) -> None:
        pass

    def estimates(self) -> dict:
        return {}


def _run_auto(
    path: Path,
    params: list[SamplingParams],
    policy: object = None,
    prepared: list | None = None,
) -> tuple[dict, LLMEngine]:
    """``_run`` under ``speculative: auto`` with ``policy`` (default one that always wants
    drafts); the steps flattened ahead of their launch go to ``prepared``."""
    config = EngineConfig(
        model=str(path), device="cpu", dtype="float32", block_size=4,
        kv_cache_memory=1 << 24, max_num_seqs=5, async_scheduling=True, profile_steps=True,
        speculative=SpeculativeConfig(method="auto", max_tokens=3),
    )  # fmt: skip
    engine = LLMEngine(config)
    engine.policy = _AlwaysDraft() if policy is None else policy
    engine.policy.scheduler = engine.scheduler
    if prepared is not None:
        prepare = engine.runner.prepare
        engine.runner.prepare = lambda step: prepared.append(step) or prepare(step)
    for i, (prompt, p) in enumerate(zip(_prompts(len(params)), params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    return done, engine


def test_auto_leaves_constrained_rows_plain(tiny_path) -> None:
    """Under ``auto`` rows with a grammar take no drafts (their drafted steps lost on the
    GPU): a batch of only constrained rows never asks the proposer nor leaves async
    scheduling, however much the policy wants drafts; in a mixed batch the plain rows
    draft and the constrained ones do not. Outputs are token-by-token decoding's."""
    params = [p for p in _params(N) if p.structured_output is not None]
    want, _ = _run(tiny_path, params)
    got, engine = _run_auto(tiny_path, params)
    assert _summary(got) == _summary(want)
    assert engine.scheduler.stats.num_propose_calls == 0
    assert engine.step_profile()["synchronous_steps"] == 0
    assert engine._grammars.stats.drafts_walked == 0

    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    mixed = [p if i % 2 else plain for i, p in enumerate(params)]
    want, _ = _run(tiny_path, mixed)
    got, engine = _run_auto(tiny_path, mixed)
    assert _summary(got) == _summary(want)
    assert engine.scheduler.stats.num_propose_calls > 0  # the plain rows were offered drafts
    assert engine._grammars.stats.drafts_walked == 0


def test_auto_schedules_ahead_while_masks_fill(tiny_path) -> None:
    """With a proposer, a step that will not draft is still scheduled and flattened while
    the grammars fill the masks of the step before (the overlap a batch of constrained rows
    under ``auto`` had lost); a step the policy wants drafted is not (its drafts come from
    the state when it is launched). Outputs are token-by-token decoding's either way."""
    params = [p for p in _params(N) if p.structured_output is not None]
    want, _ = _run(tiny_path, params)
    prepared: list = []
    got, _ = _run_auto(tiny_path, params, _AlwaysDraft(), prepared)
    assert _summary(got) == _summary(want)
    assert len(prepared) > 5  # (they take no drafts, however much the policy wants them)
    # Plain rows beside them, which the policy wants drafted: no step of theirs is
    # scheduled ahead.
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    mixed = [p if i % 2 else plain for i, p in enumerate(_params(N))]
    want, _ = _run(tiny_path, mixed)
    prepared = []
    got, _ = _run_auto(tiny_path, mixed, _AlwaysDraft(), prepared)
    assert _summary(got) == _summary(want)
    assert prepared  # once the plain rows are done
    for step in prepared:  # none while a plain row runs
        assert all(req.sampling_params.structured_output for req in step.requests)


class _EveryOther(_AlwaysDraft):
    """A policy that wants every other step the scheduler makes drafted."""

    def __init__(self) -> None:
        self.scheduler = None

    def wants_drafts(self, batch: int, slowest_yield: float | None = None) -> bool:
        return self.scheduler.stats.num_steps % 2 == 0


def test_a_step_scheduled_ahead_after_a_drafted_one_keeps_the_outputs(tiny_path) -> None:
    """Drafted steps (drafted ahead of the step in flight: fewer than 8 rows) and plain
    steps scheduled ahead while masks fill, in turn: the outputs of constrained and plain
    rows are still token-by-token decoding's."""
    plain = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    mixed = [p if i % 2 else plain for i, p in enumerate(_params(N))]
    want, _ = _run(tiny_path, mixed)
    policy = _EveryOther()
    prepared: list = []
    got, engine = _run_auto(tiny_path, mixed, policy, prepared)
    assert engine.scheduler.config.drafts_ahead
    assert _summary(got) == _summary(want)
    assert prepared and engine.scheduler.stats.num_drafted_rows > 0
