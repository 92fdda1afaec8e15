"""Grammar lookups by batch slot (grammar_slots.py) give every row its own request's grammar
whatever happened to its slot: a random run of admissions, finishes, aborts, preemptions and
re-admissions elsewhere, with each step's tokens fed after the next step's slots changed
(async scheduling), gives the lookup by request id's masks and endings; and engine runs that
preempt, re-admit, abort and reuse slots check every lookup against the one by id."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.engine.test_structured_output import TINY_SCHEMA, validate
from tests.tiny_models import EOS_ID, save_tiny_model, save_tiny_tokenizer
from tokenmill import LLM, SamplingParams
from tokenmill.engine.core.request import Request
from tokenmill.engine.engine_config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.structured_output import StructuredOutputs, _objects

BLOCK = 4
SPECS: list[Any] = [TINY_SCHEMA, "json_object", 'choice:["yes","no","maybe"]', "regex:[a-c]{2,5}"]


def _allowed(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


class _Slots:
    """A batch of ``capacity`` slots the way the scheduler uses them: lowest free first."""

    def __init__(self, capacity: int) -> None:
        self.of: dict[int, Request] = {}  # slot -> request
        self.capacity = capacity

    def admit(self, req: Request) -> int:
        slot = min(set(range(self.capacity)) - set(self.of))
        self.of[slot] = req
        return slot

    def leave(self, req: Request) -> None:
        del self.of[next(s for s, r in self.of.items() if r is req)]


@pytest.mark.parametrize("seed", range(4))
def test_slot_lookup_gives_the_id_lookups_masks_through_slot_churn(tmp_path, seed: int) -> None:
    tokenizer = save_tiny_tokenizer(tmp_path / "tok")
    by_slot = StructuredOutputs(tokenizer, vocab_size=288, eos_token_ids=[EOS_ID])
    by_id = StructuredOutputs(tokenizer, vocab_size=288, eos_token_ids=[EOS_ID])
    rng = random.Random(seed)
    slots, waiting, serial = _Slots(6), [], 0
    in_flight: tuple[list[Request], list[int], list[int]] | None = None
    looked_up = [0, 0]  # rows, rows looked up by id (misses)
    find = by_slot._find

    def counting_find(requests: np.ndarray) -> np.ndarray:
        looked_up[1] += len(requests)
        return find(requests)

    by_slot._find = counting_find  # type: ignore[method-assign]
    for _ in range(120):
        # churn, as a step's processing and the next schedule do while a step is in flight
        for req in list(slots.of.values()):
            roll = rng.random()
            if roll < 0.12:  # finished or aborted: its grammar goes at once
                slots.leave(req)
                for grammars in (by_slot, by_id):
                    grammars.drop([req.request_id])
            elif roll < 0.22:  # preempted: keeps its grammar, waits for another slot
                slots.leave(req)
                waiting.append(req)
        while rng.random() < 0.5:
            # new requests; now and then under a finished one's id (its row may be in flight)
            spec = rng.choice([*SPECS, None])
            rid = f"r{serial}" if rng.random() < 0.8 else f"r{rng.randrange(serial + 1)}"
            serial += 1
            if any(r.request_id == rid for r in [*waiting, *slots.of.values()]):
                rid = f"r{serial}"
            req = Request(rid, [5], SamplingParams(structured_output=spec), (EOS_ID,))
            if spec is not None:
                for grammars in (by_slot, by_id):
                    grammars.add(req)
            waiting.append(req)
        rng.shuffle(waiting)
        while waiting and len(slots.of) < slots.capacity:
            slots.admit(waiting.pop())
        # the step in flight's tokens are fed now: some of its rows' slots changed hands
        if in_flight is not None:
            requests, row_slots, tokens = in_flight
            by_slot.feed(requests, tokens, slots=np.array(row_slots))
            by_id.feed(requests, tokens)
            ended = by_slot.take_ended()
            assert ended == by_id.take_ended()
            for rid in ended:
                req = next(r for r in [*waiting, *slots.of.values()] if r.request_id == rid)
                if req in waiting:  # preempted since its step ran
                    waiting.remove(req)
                else:
                    slots.leave(req)
                for grammars in (by_slot, by_id):
                    grammars.drop([rid])
        step = sorted(slots.of.items())
        requests = [r for _, r in step]
        row_slots = [s for s, _ in step]
        constrained = [i for i, r in enumerate(requests) if r.request_id in by_id._index]
        tokens = [rng.randrange(5, 250) for _ in requests]
        if constrained:
            rows = np.array(requests, dtype=object)[constrained]
            masks = by_slot.bitmask(rows, slots=np.array(row_slots)[constrained]).copy()
            assert np.array_equal(masks, by_id.bitmask(list(rows)))
            looked_up[0] += len(rows)
            for i, mask in zip(constrained, masks, strict=True):
                tokens[i] = int(rng.choice(_allowed(mask)))
        in_flight = (requests, row_slots, tokens)
        looked_up[0] += len(requests)
    assert looked_up[1] < looked_up[0] / 2  # most rows were found by slot


def test_a_finished_rows_token_fed_after_its_slot_and_index_went_to_another_request(
    tmp_path,
) -> None:
    """Step n ran ``a`` in slot 0; ``a`` finished while step n was in flight and ``b`` took
    its slot and its grammar index: step n's token is not ``b``'s."""
    grammars = StructuredOutputs(save_tiny_tokenizer(tmp_path), 288, [EOS_ID])
    a, b = (Request(r, [5], SamplingParams(structured_output=TINY_SCHEMA)) for r in "ab")
    slot0 = np.array([0])
    grammars.add(a)
    first = grammars.bitmask([a], slots=slot0).copy()
    brace = int(_allowed(first[0])[0])
    grammars.drop(["a"])
    grammars.add(b)
    assert grammars._index["b"] == 0  # a's index: a stale entry would name b's grammar
    grammars.feed([a], [brace], slots=slot0)
    assert np.array_equal(grammars.bitmask([b], slots=slot0), first)  # b's grammar is fresh
    grammars.feed([b], [brace], slots=slot0)  # and took its one token
    with pytest.raises(RuntimeError, match="no grammar"):
        grammars.bitmask([a], slots=slot0)


def test_a_request_given_a_grammar_again_is_not_taken_for_one_without(tmp_path) -> None:
    """A constrained request looked up after its grammar was dropped is not remembered as
    having none: the same request given a grammar again is found."""
    grammars = StructuredOutputs(save_tiny_tokenizer(tmp_path), 288, [EOS_ID])
    a = Request("a", [5], SamplingParams(structured_output=TINY_SCHEMA))
    grammars.add(a)
    first = grammars.bitmask([a], slots=np.array([2])).copy()
    grammars.drop(["a"])
    grammars.feed([a], [int(_allowed(first[0])[0])], slots=np.array([2]))  # skipped
    grammars.add(a)
    assert np.array_equal(grammars.bitmask([a], slots=np.array([2])), first)


# ---- the engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("grammar_slots") / "m")


def _prompts(n: int) -> list[list[int]]:
    return [[(37 * i + 13 * t) % 250 + 5 for t in range(5 + i % 7)] for i in range(n)]


def _params(n: int) -> list[SamplingParams]:
    """Two of three rows constrained (a schema, a choice), greedy and seeded; plain between."""
    kinds: list[Any] = [TINY_SCHEMA, None, 'choice:["yes","no","maybe"]']
    return [
        SamplingParams(
            max_tokens=30, temperature=0 if i % 2 else 1.0, seed=i, structured_output=kinds[i % 3]
        )
        for i in range(n)
    ]


class _Audit:
    """Checks each of the engine's grammar lookups against the one by request id, and counts
    the rows fed after their request left the slot they ran in, and the requests seen in
    more than one slot (re-admitted elsewhere after a preemption)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.rows = self.left = 0
        self.slots: dict[int, set[int]] = {}
        grammars, table = engine._grammars, engine.scheduler.slots
        inner = grammars._indices

        def checked(requests, missing: str, slots=None) -> np.ndarray:
            assert slots is not None  # the engine always passes the rows' slots
            got = inner(requests, missing, slots)
            reqs = _objects(requests)
            assert got.tolist() == grammars._find(reqs).tolist()
            self.rows += len(reqs)
            self.left += int(np.count_nonzero(table.requests[slots] != reqs))
            for req, slot in zip(reqs, np.asarray(slots).tolist(), strict=True):
                self.slots.setdefault(id(req), set()).add(slot)
            return got

        grammars._indices = checked  # type: ignore[method-assign]

    @property
    def moved(self) -> int:
        return sum(len(s) > 1 for s in self.slots.values())


def _check(outs: list[RequestOutput], params: list[SamplingParams]) -> None:
    for out, p in zip(outs, params, strict=True):
        spec = p.structured_output
        for c in out.outputs:
            if spec is None or c.finish_reason != "stop":
                continue
            if spec.startswith("choice:"):
                assert c.text in json.loads(spec.removeprefix("choice:"))
            else:
                validate(c.text, TINY_SCHEMA)


def _summary(outs: list[RequestOutput]) -> list[tuple]:
    return [tuple((tuple(c.token_ids), c.finish_reason) for c in o.outputs) for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_path) -> list[RequestOutput]:
    """Big KV cache, one batch, synchronous."""
    params = [
        *_params(11),
        SamplingParams(n=3, max_tokens=30, seed=5, structured_output=TINY_SCHEMA),
    ]
    llm = LLM(str(tiny_path), device="cpu", dtype="float32", block_size=BLOCK,
              kv_cache_memory=1 << 24, async_scheduling=False)  # fmt: skip
    outs = llm.generate(_prompts(12), params)
    _check(outs, params)
    assert all(c.finish_reason == "stop" for o, p in zip(outs, params, strict=True)
               if p.structured_output is not None for c in o.outputs)  # fmt: skip
    return outs


@pytest.mark.parametrize(
    ("async_scheduling", "backend", "processes"),
    [
        (True, "llguidance", 0),
        (False, "llguidance", 0),
        (True, "llguidance", 2),
        (True, "xgrammar", 0),
        (False, "xgrammar", 2),
    ],  # fmt: skip
)
def test_preempted_readmitted_and_slot_reusing_rows_keep_their_own_grammars(
    tiny_path, reference, async_scheduling: bool, backend: str, processes: int
) -> None:
    """A tiny KV cache (preemption by recompute, re-admission into other slots) and four
    slots for fourteen rows (finished rows' slots taken by new constrained rows in the same
    step), constrained and plain rows mixed, n = 3 of one constrained prompt."""
    if backend == "xgrammar":
        pytest.importorskip("xgrammar")
    params = [
        *_params(11),
        SamplingParams(n=3, max_tokens=30, seed=5, structured_output=TINY_SCHEMA),
    ]
    llm = LLM(str(tiny_path), device="cpu", dtype="float32", block_size=BLOCK,
              kv_cache_memory=20480, max_num_seqs=4, async_scheduling=async_scheduling,
              structured_output_backend=backend, structured_output_processes=processes)  # fmt: skip
    audit = _Audit(llm.engine)
    outs = llm.generate(_prompts(12), params)
    assert llm.engine.scheduler.stats.num_preemptions > 0 and audit.moved > 0
    if async_scheduling:
        assert audit.left > 0  # rows fed after another request took their slot
    rows = [i for i, p in enumerate(params) if p.structured_output is not None]
    assert [_summary(outs)[i] for i in rows] == [_summary(reference)[i] for i in rows]
    _check(outs, params)
    assert len(llm.engine._grammars) == 0 and not llm.engine.has_unfinished()
    llm.close()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_aborts_mid_run_leave_the_other_rows_their_grammars(
    tiny_path, reference, async_scheduling: bool
) -> None:
    params, prompts = _params(11), _prompts(11)
    config = EngineConfig(model=str(tiny_path), device="cpu", dtype="float32", block_size=BLOCK,
                          kv_cache_memory=1 << 24, max_num_seqs=4,
                          async_scheduling=async_scheduling)  # fmt: skip
    engine = LLMEngine(config)
    audit = _Audit(engine)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    done: dict[str, RequestOutput] = {}
    aborted = ["r1", "r4", "r8"]  # a plain row, a seeded schema row, a choice row
    for step in range(400):
        if not engine.has_unfinished():
            break
        done.update((o.request_id, o) for o in engine.step())
        if step in (3, 9):  # some running with a step in flight, some still waiting
            engine.abort_requests(aborted[:2] if step == 3 else aborted[2:])
    engine.close()
    assert audit.rows > 0
    want = {f"r{i}": _summary([o]) for i, o in enumerate(reference[:11])}
    got = {rid: _summary([o]) for rid, o in done.items()}
    assert len(got) >= 8 and got == {rid: want[rid] for rid in got}


def test_forget_clears_exactly_the_entries_holding_the_dropped_indices() -> None:
    """Entries holding a dropped index go, whatever else the table holds: indices above
    and below the dropped ones, and -1 (a request without a grammar) stay."""
    from tokenmill.engine.grammar_slots import GrammarSlots

    owners = np.array([object() for _ in range(8)], dtype=object)
    indices = np.array([5, -1, 2, 9, 2, 0, 7, -1], dtype=np.int64)
    slots = GrammarSlots()
    got = slots.lookup(
        owners,
        np.arange(8),
        find=lambda reqs: indices[[list(owners).index(r) for r in reqs]],
        constrained=lambda reqs: np.zeros(len(reqs), dtype=np.bool_),
    )
    assert got.tolist() == indices.tolist()
    slots.forget([2, 7, 4])  # 4: held by no entry
    kept = slots._owner != None  # noqa: E711 (elementwise)
    assert slots._index.tolist() == [5, -1, -1, 9, -1, 0, -1, -1]
    assert kept.tolist() == [True, True, False, True, False, True, False, True]
    slots.forget([0])
    assert slots._index.tolist() == [5, -1, -1, 9, -1, -1, -1, -1]
