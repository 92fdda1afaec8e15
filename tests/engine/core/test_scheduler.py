"""Scheduler tests with the real KV cache manager and a fake model, on tiny block sizes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tokenmill.engine.core import KVCacheManager
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.engine.core.scheduler_output import SchedulerOutput
from tokenmill.engine.sampling_params import SamplingParams

VOCAB = 50


def fake_next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole sequence."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + len(tokens)) % VOCAB


def make_scheduler(
    num_blocks: int,
    block_size: int,
    budget: int = 64,
    max_seqs: int = 16,
    prefix: bool = True,
    max_model_len: int = 10_000,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(max_seqs, budget, max_model_len), kv)


def apply_sampled(
    sched: Scheduler, out: SchedulerOutput, sampled: dict[str, list[int]]
) -> list[Request]:
    """Feed ``{request id: [token]}`` to ``update_from_output``; return the finished ones."""
    rows = [i for i, req in enumerate(out.requests) if req.request_id in sampled]
    tokens = [sampled[out.requests[i].request_id][0] for i in rows]
    return sched.update_from_output(out, np.asarray(rows), np.asarray(tokens)).finished


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    """Drive the scheduler with the fake model; check invariants after every step."""
    outputs = []
    shadow: dict[str, int] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outputs
        out = sched.schedule()
        assert not out.is_empty, "scheduler made no progress"
        assert out.num_tokens <= sched.config.max_num_batched_tokens
        assert len(out.scheduled) <= sched.config.max_num_seqs
        sampled = {}
        for item in out.scheduled:
            req = item.request
            # The step continues exactly where computation stopped, or later after a hit.
            assert item.start >= shadow.get(req.request_id, 0) or req.num_preemptions
            assert item.end <= req.num_tokens
            assert len(item.block_ids) * sched.kv.block_size >= item.end
            shadow[req.request_id] = item.end
            if item.sample:
                assert item.end == req.num_tokens
                sampled[req.request_id] = [fake_next_token(req.all_token_ids)]
        for rid in out.preempted_ids:
            shadow[rid] = 0
        apply_sampled(sched, out, sampled)
        sched.kv.check_integrity()
        outputs.append(out)
    raise AssertionError("did not finish")


def make_requests(n: int, seed: int, shared_prefix: int = 0, max_tokens: int = 8) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    reqs = []
    for i in range(n):
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(max_tokens=rng.randint(1, max_tokens), temperature=0)
        reqs.append(Request(f"r{i}", prompt, params, arrival_index=i))
    return reqs


def expected_outputs(reqs: list[Request]) -> dict[str, list[int]]:
    result = {}
    for r in reqs:
        seq = list(r.prompt_token_ids)
        out = []
        for _ in range(r.sampling_params.max_tokens):
            tok = fake_next_token(seq)
            seq.append(tok)
            out.append(tok)
        result[r.request_id] = out
    return result


def test_all_finish_with_expected_tokens() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4)
    reqs = make_requests(6, seed=0)
    expected = expected_outputs(reqs)
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched)
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected[r.request_id]
    assert sched.kv.num_free_blocks == 64


def test_chunked_prefill_samples_only_at_the_end() -> None:
    sched = make_scheduler(num_blocks=32, block_size=2, budget=4)
    req = Request("a", list(range(10)), SamplingParams(max_tokens=2, temperature=0))
    sched.add_request(req)
    outs = run_to_completion(sched)
    chunks = [
        (o.scheduled[0].start, o.scheduled[0].num_new_tokens, o.scheduled[0].sample) for o in outs
    ]
    assert chunks[:3] == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert chunks[3] == (10, 1, True)
    assert len(req.output_token_ids) == 2


def test_max_num_seqs_is_respected() -> None:
    sched = make_scheduler(num_blocks=256, block_size=4, max_seqs=3)
    for r in make_requests(10, seed=1):
        sched.add_request(r)
    outs = run_to_completion(sched)
    assert max(len(o.scheduled) for o in outs) == 3


def test_preemption_by_recompute_keeps_outputs() -> None:
    reqs = make_requests(8, seed=2, max_tokens=20)
    expected = expected_outputs(reqs)
    # 12 blocks of 2 tokens: far too few for 8 requests growing to ~30 tokens each.
    sched = make_scheduler(num_blocks=16, block_size=2, budget=32)
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched)
    assert sched.stats.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == expected[r.request_id]


def test_prefix_cache_hit_skips_computation() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4)
    prompt = list(range(1, 18))  # 17 tokens: 4 full blocks
    first = Request("a", prompt, SamplingParams(max_tokens=1, temperature=0))
    sched.add_request(first)
    run_to_completion(sched)
    second = Request("b", prompt[:16] + [40, 41], SamplingParams(max_tokens=1, temperature=0))
    sched.add_request(second)
    out = sched.schedule()
    assert out.scheduled[0].start == 16 and out.scheduled[0].num_new_tokens == 2
    assert second.num_cached_prompt_tokens == 16
    assert sched.kv.prefix_cache_stats.hit_tokens == 16


def test_output_blocks_are_cached_when_the_request_finishes_not_as_they_fill() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4)
    prompt = list(range(1, 10))  # 9 tokens: 2 full prompt blocks
    first = Request("a", prompt, SamplingParams(max_tokens=12, temperature=0))
    sched.add_request(first)
    for _ in range(8):  # the prefill and 7 decode steps: 16 tokens computed
        out = sched.schedule()
        apply_sampled(sched, out, {"a": [fake_next_token(first.all_token_ids)]})
    assert sched.slots.num_cached_full[first.slot] == 2  # only the prompt's, so far
    run_to_completion(sched)
    # 20 tokens, 20 computed but the last: 4 full blocks, the last two of outputs only
    turn = first.all_token_ids[:16] + [1, 2, 3]  # a next turn repeating prompt + output
    second = Request("b", turn, SamplingParams(max_tokens=1, temperature=0))
    sched.add_request(second)
    assert sched.schedule().scheduled[0].start == 16


def test_a_preempted_request_finds_its_output_blocks_cached() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4)
    req = Request("a", list(range(1, 6)), SamplingParams(max_tokens=20, temperature=0))
    sched.add_request(req)
    for _ in range(12):  # 16 tokens computed: 4 full blocks, 2 of them outputs
        out = sched.schedule()
        apply_sampled(sched, out, {"a": [fake_next_token(req.all_token_ids)]})
    slot = req.slot
    sched._preempt(req)  # as _schedule_running does when the pool runs out
    sched._drop_running([slot])
    out = sched.schedule()
    assert out.scheduled[0].start == 16  # recomputes only past its cached blocks
    assert req.num_preemptions == 1


def test_fully_cached_prompt_still_computes_last_token() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4)
    prompt = list(range(1, 17))  # exactly 4 blocks
    for rid in ("a", "b"):
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=1, temperature=0)))
        outs = run_to_completion(sched)
    first = outs[0].scheduled[0]
    assert first.start == 12 and first.num_new_tokens == 4 and first.sample


def test_prompt_longer_than_context_is_refused() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, max_model_len=10)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("a", list(range(10)), SamplingParams()))


def test_generation_stops_at_max_model_len() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, max_model_len=12)
    req = Request("a", list(range(8)), SamplingParams(max_tokens=100, temperature=0))
    sched.add_request(req)
    run_to_completion(sched)
    assert req.status is RequestStatus.FINISHED_LENGTH and req.num_tokens == 12


def test_eos_and_stop_token_ids() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4)
    prompt = [1, 2, 3]
    first_token = fake_next_token(prompt)
    eos = Request(
        "eos", prompt, SamplingParams(max_tokens=5, temperature=0), eos_token_ids=(first_token,)
    )
    ignored = Request(
        "ign",
        prompt,
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        eos_token_ids=(first_token,),
    )
    stop_id = Request(
        "stop", prompt, SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[first_token])
    )
    min_tok = Request(
        "min",
        prompt,
        SamplingParams(max_tokens=5, min_tokens=3, temperature=0),
        eos_token_ids=(first_token,),
    )
    for r in (eos, ignored, stop_id, min_tok):
        sched.add_request(r)
    run_to_completion(sched)
    assert eos.output_token_ids == [first_token] and eos.status is RequestStatus.FINISHED_STOPPED
    assert ignored.num_output_tokens == 5 and ignored.status is RequestStatus.FINISHED_LENGTH
    assert stop_id.stop_reason == first_token and stop_id.num_output_tokens == 1
    assert min_tok.num_output_tokens >= 3


def test_finish_requests_frees_blocks() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4)
    reqs = make_requests(3, seed=5)
    for r in reqs:
        sched.add_request(r)
    sched.schedule()
    sched.finish_requests(["r0", "r2"], RequestStatus.FINISHED_ABORTED)
    sched.kv.check_integrity()
    assert [r.request_id for r in sched.running] == ["r1"]
    assert reqs[0].status is RequestStatus.FINISHED_ABORTED


def test_finish_requests_takes_running_and_waiting_ones_in_one_call() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, max_seqs=2)
    reqs = make_requests(4, seed=5)
    for r in reqs:
        sched.add_request(r)
    sched.schedule()  # r0, r1 run; r2, r3 wait
    sched.finish_requests(["r1", "r3", "unknown"], RequestStatus.FINISHED_ABORTED)
    sched.kv.check_integrity()
    assert [r.request_id for r in sched.running] == ["r0"]
    assert [r.request_id for r in sched.waiting] == ["r2"]
    assert reqs[1].status is reqs[3].status is RequestStatus.FINISHED_ABORTED
    sched.finish_requests(["r2"], RequestStatus.FINISHED_ABORTED)  # a waiting one alone
    assert not sched.waiting and reqs[2].status is RequestStatus.FINISHED_ABORTED


def _finish_order(by_request: bool) -> tuple[list[str], list[int]]:
    """Finish two running and two waiting requests, given out of order, through ``finish``
    or ``finish_requests``; (the ids in the order retired, the free block ids after)."""
    sched = make_scheduler(num_blocks=64, block_size=4, max_seqs=3)
    reqs = make_requests(6, seed=5)
    for r in reqs:
        sched.add_request(r)
    sched.schedule()  # r0, r1, r2 run; r3, r4, r5 wait
    retired: list[str] = []
    retire = sched._retire

    def recorded(req: Request, status: RequestStatus) -> None:
        retired.append(req.request_id)
        retire(req, status)

    sched._retire = recorded
    given = [reqs[4], reqs[2], reqs[3], reqs[0]]
    if by_request:
        sched.finish(given, RequestStatus.FINISHED_STOPPED)
    else:
        sched.finish_requests([r.request_id for r in given], RequestStatus.FINISHED_STOPPED)
    sched.kv.check_integrity()
    assert [r.request_id for r in sched.running] == ["r1"]
    assert [r.request_id for r in sched.waiting] == ["r5"]
    sched.finish([reqs[0]], RequestStatus.FINISHED_ABORTED)  # finished: left as it is
    assert reqs[0].status is RequestStatus.FINISHED_STOPPED
    return retired, sched.kv.pool.free_block_ids()


def test_finish_takes_requests_in_admission_then_queue_order() -> None:
    """``finish`` (the engine's, by request) retires as ``finish_requests`` does: running
    rows oldest admission first, then waiting ones in queue order, whatever order they are
    given in; so their blocks join the free queue in the same order."""
    by_id = _finish_order(by_request=False)
    assert by_id[0] == ["r0", "r2", "r3", "r4"]
    assert _finish_order(by_request=True) == by_id


@pytest.mark.parametrize("block_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(6))
def test_random_configs_give_identical_outputs(block_size: int, seed: int) -> None:
    """Same outputs whatever the pool size, budget and prefix caching."""
    rng = random.Random(seed * 10 + block_size)
    reqs_template = make_requests(10, seed=seed, shared_prefix=rng.choice([0, 5, 9]), max_tokens=10)
    expected = expected_outputs(reqs_template)
    # Smallest pool that still fits the longest request alone.
    longest = max(r.num_tokens + r.sampling_params.max_tokens for r in reqs_template)
    min_blocks = -(-longest // block_size) + 1
    for num_blocks, budget, prefix in [
        (min_blocks, rng.randint(1, 8), True),
        (min_blocks * 3, rng.randint(4, 32), False),
        (512, 256, True),
    ]:
        reqs = [
            Request(r.request_id, list(r.prompt_token_ids), r.sampling_params)
            for r in reqs_template
        ]
        sched = make_scheduler(num_blocks, block_size, budget=budget, max_seqs=4, prefix=prefix)
        for r in reqs:
            sched.add_request(r)
        run_to_completion(sched)
        assert {r.request_id: r.output_token_ids for r in reqs} == expected
        assert sched.kv.num_free_blocks == num_blocks


def test_prefix_shared_within_one_step() -> None:
    """Blocks are cached when scheduled, so a request admitted later in the same step hits."""
    sched = make_scheduler(num_blocks=64, block_size=4)
    prompt = list(range(1, 18))
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=1, temperature=0)))
    sched.add_request(Request("b", prompt[:16] + [9], SamplingParams(max_tokens=1, temperature=0)))
    out = sched.schedule()
    assert [(s.request_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 0, 17),
        ("b", 16, 1),
    ]
    assert out.scheduled[0].block_ids[:4] == out.scheduled[1].block_ids[:4]


def test_admission_waits_for_a_batch_of_free_slots() -> None:
    """With admit_batch 3, running requests hold back admissions until 3 slots are free (or
    every waiting request fits); the outputs are those of admitting at once."""
    kv = KVCacheManager(256, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(4, 64, 10_000, admit_batch=3), kv)
    reqs = [
        Request(f"r{i}", [i + 1, i + 2, i + 3], SamplingParams(max_tokens=2 + i, temperature=0))
        for i in range(7)
    ]
    for req in reqs:
        sched.add_request(req)
    admitted_per_step = []
    while sched.has_unfinished():
        before = {r.request_id for r in sched.running}
        out = sched.schedule()
        new = [r.request_id for r in out.requests if r.request_id not in before]
        admitted_per_step.append(len(new))
        apply_sampled(
            sched,
            out,
            {r.request_id: [fake_next_token(r.all_token_ids)] for r in out.requests},
        )
    assert admitted_per_step[0] == 4  # nothing runs yet: fill every slot
    later = [n for n in admitted_per_step[1:] if n]
    assert later == [3]  # r0..r2 finish one by one; r4..r6 enter together
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert kv.num_free_blocks == 256


class _AlwaysDrafts:
    """Proposes ``max_drafts`` tokens (7s) for every row it is asked about."""

    max_drafts = 3

    def propose(self, slots, rows: np.ndarray) -> np.ndarray:
        return np.full((len(rows), self.max_drafts), 7, dtype=np.int64)


@pytest.mark.parametrize("prompt_len", [30, 20])
def test_drafts_take_only_the_budget_the_admitted_prompts_leave(prompt_len: int) -> None:
    """4 rows decoding, 2 waiting, a 64-token step. 30-token prompts: the drafts (4 x 3)
    took budget the prompts needed, so the second was split over another prefill step; now
    no drafts, both prompts whole. 20-token prompts leave room: drafts and both prompts."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(8, 64, 1000), kv, proposer=_AlwaysDrafts())
    for i in range(4):
        sched.add_request(Request(f"run{i}", [1, 2, 3], SamplingParams(max_tokens=50)))
    first = sched.schedule()  # the four prompts
    apply_sampled(sched, first, {f"run{i}": [5] for i in range(4)})
    for i in range(2):
        prompt = list(range(1, prompt_len + 1))
        sched.add_request(Request(f"wait{i}", prompt, SamplingParams(max_tokens=5)))
    out = sched.schedule()
    drafts = 0 if prompt_len == 30 else 3
    assert out.drafts.tolist() == [drafts] * 4 + [0, 0]
    assert out.num_new.tolist() == [1 + drafts] * 4 + [prompt_len] * 2


def test_a_full_kv_cache_admits_nothing_and_leaves_the_drafts_be() -> None:
    """Free slots but no free blocks (a KV-bound job's steady state): nothing is admitted,
    so the waiting prompts take none of the budget and the running rows draft (the first
    cut reserved their tokens anyway: no drafts for most of such a run)."""
    kv = KVCacheManager(6, 4, enable_prefix_caching=False)  # 24 tokens of KV in all
    sched = Scheduler(SchedulerConfig(8, 64, 1000), kv, proposer=_AlwaysDrafts())
    for i in range(2):
        sched.add_request(Request(f"run{i}", [1, 2, 3, 4, 5], SamplingParams(max_tokens=10)))
    apply_sampled(sched, sched.schedule(), {f"run{i}": [5] for i in range(2)})
    assert kv.num_free_blocks == 2  # room for the drafts, not for a 60-token prompt
    sched.add_request(Request("wait", list(range(1, 61)), SamplingParams(max_tokens=5)))
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["run0", "run1"]  # no room for "wait"
    assert out.drafts.tolist() == [3, 3]
