"""SpeculationPolicy: drafts where measured goodput says it pays, probes the other mode."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.spec_decode.policy import SpeculationPolicy, StepSample


def _feed(policy: SpeculationPolicy, batch: int, steps: int, plain_ms: float, draft_ms: float,
          share: float, accepted: float) -> list[bool]:  # fmt: skip
    """Run ``steps`` decisions, each followed by the step it chose, with these costs."""
    chosen = []
    for _ in range(steps):
        draft = policy.wants_drafts(batch)
        chosen.append(draft)
        rows = round(share * batch)
        policy.record(
            StepSample(batch, draft, draft_ms if draft else plain_ms, rows, round(rows * accepted))
            if draft
            else StepSample(batch, False, plain_ms)
        )
    return chosen


def test_drafts_when_it_pays_and_probes_plain_now_and_then() -> None:
    policy = SpeculationPolicy(probe_every=50)
    # Drafting: 1 + 0.8 * 2 = 2.6 tokens a row in 1.5x the time: it pays.
    chosen = _feed(policy, 8, 500, plain_ms=10.0, draft_ms=15.0, share=0.8, accepted=2.0)
    assert chosen[0] is False and chosen[1] is True  # a plain step is timed first
    assert sum(not c for c in chosen) <= 500 // 50 + 2  # plain only to measure it (probes)
    assert policy.estimates()[8]["draft_ms"] == 15.0


def test_stays_plain_where_drafts_do_not_pay_but_probes_them() -> None:
    policy = SpeculationPolicy(probe_every=50)
    # 1 + 0.1 * 0.5 = 1.05 tokens a row for 2x the time: plain wins.
    chosen = _feed(policy, 256, 500, plain_ms=10.0, draft_ms=20.0, share=0.1, accepted=0.5)
    drafted = sum(chosen)
    assert 1 <= drafted <= 500 // 50 + policy.warmup + 1, drafted
    # Cost of the probes against always plain: at most 1 step in 50 at 2x.
    assert drafted * 20.0 + (500 - drafted) * 10.0 <= 500 * 10.0 * 1.03


def test_the_margin_keeps_a_tie_plain() -> None:
    policy = SpeculationPolicy(probe_every=1000, probe_drafts_every=1000, margin=0.03)
    chosen = _feed(policy, 4, 100, plain_ms=10.0, draft_ms=10.2, share=1.0, accepted=0.02)
    # 1.02 tokens in 1.02x the time: not worth it, once warmed up
    warm = chosen[1 : 1 + policy.warmup]
    assert not chosen[0] and all(warm) and not any(chosen[policy.warmup + 2 :])


def test_batch_buckets_learn_apart() -> None:
    policy = SpeculationPolicy(probe_every=1000, probe_drafts_every=1000)
    _feed(policy, 2, 50, plain_ms=5.0, draft_ms=6.0, share=1.0, accepted=2.0)  # pays
    _feed(policy, 300, 50, plain_ms=10.0, draft_ms=25.0, share=0.5, accepted=0.5)  # does not
    assert policy.wants_drafts(2) and not policy.wants_drafts(300)
    assert sorted(policy.estimates()) == [2, 512]


def test_drafting_is_probed_on_its_own_cadence() -> None:
    """Synchronous engines probe drafting after every 10 plain steps while plain wins (here
    a probe may cost a tenth of the plain time between two): one probe that sees drafts pay
    brings drafting back at once."""
    policy = SpeculationPolicy(probe_every=50, probe_drafts_every=10, probe_share=0.1)
    chosen = _feed(policy, 1, 100, plain_ms=10.0, draft_ms=20.0, share=0.2, accepted=1.0)
    probes = [i for i, c in enumerate(chosen) if c][policy.warmup :]
    assert probes and all(b - a == 11 for a, b in zip(probes, probes[1:], strict=False)), probes
    # Now the drafts pay (share 1, 3 accepted a row): within a few probes (the running means
    # move a fifth of the way a sample) it drafts every step.
    chosen = _feed(policy, 1, 60, plain_ms=10.0, draft_ms=12.0, share=1.0, accepted=3.0)
    assert all(chosen[-20:]), chosen


def test_switching_to_drafting_and_back_is_paid_once_a_run() -> None:
    """Switching to synchronous drafted steps leaves the device idle while the step in
    flight is processed, and switching back while the next plain step launches: costs of
    a run of drafted steps, not of each (they made every isolated probe look like a
    drafted step's steady cost, and a bucket first seen late never drafted where drafting
    paid, a review's simulation). They are spread over the run (probe_every steps) and paid
    in full by a probe."""
    policy = SpeculationPolicy(warmup=1, probe_every=50)
    policy.record(StepSample(8, False, 5.5))
    # 2 tokens a row in 10 ms, after 5 ms processing the step in flight; 1 ms to switch back
    policy.record(StepSample(8, True, 10.0, drafted_rows=8, accepted=8, switch_ms=5.0))
    policy.charge_switch_back(8, 1.0)
    estimates = policy.estimates()[8]
    assert (estimates["draft_ms"], estimates["switch_ms"]) == (10.0, 6.0)
    assert policy.wants_drafts(8)  # 2 / (10 + 6 / 50) beats 1.03 / 5.5
    # A switch of 40 ms is 0.8 ms a drafted step of the run: 2 / 10.8 < 1.03 / 5.5
    policy = SpeculationPolicy(warmup=1, probe_every=50)
    policy.record(StepSample(8, False, 5.5))
    policy.record(StepSample(8, True, 10.0, drafted_rows=8, accepted=8, switch_ms=40.0))
    assert not policy.wants_drafts(8)
    policy.charge_switch_back(64, 2.0)  # a bucket that never drafted: nothing to charge
    assert 64 not in policy.estimates() or policy.estimates()[64]["switch_ms"] is None


def test_a_bucket_seen_late_drafts_where_drafting_pays_despite_its_switches() -> None:
    """The review's case: plain steps 10 ms; drafted ones 15 ms giving 2.5 tokens a row,
    the first of a run after 10 ms processing the step in flight and followed by 2 ms of
    launch with the device idle; the batch moves from bucket 128 to 64 at step 300. Bucket
    64 drafted 12 of 2,000 steps (each of its samples an isolated probe, its switches
    counted in its step time); it drafts nearly all of them."""
    policy = SpeculationPolicy()
    drafting = False
    chosen = []
    for step in range(2300):
        batch = 100 if step < 300 else 50
        draft = policy.wants_drafts(batch)
        if step >= 300:
            chosen.append(draft)
        if draft:
            switch = 0.0 if drafting else 10.0
            policy.record(StepSample(batch, True, 15.0, batch, round(batch * 1.5), switch))
        else:
            if drafting:
                policy.charge_switch_back(batch, 2.0)
            policy.record(StepSample(batch, False, 10.0))
        drafting = draft
    assert sum(chosen) >= 0.9 * len(chosen), sum(chosen)


def test_costly_drafting_is_probed_less_often() -> None:
    """At 256 rows of SmolLM2 on an H100 a drafted step took 5x a plain one (8.1 against 1.6
    ms): probing it every 50 plain steps cost 8% of the run. Probes now come once their
    extra time is at most probe_share (1%) of the plain steps' between them."""
    policy = SpeculationPolicy(warmup=4, max_drafts=8)  # 8 drafts: not hopeless at 5x
    chosen = _feed(policy, 256, 2000, plain_ms=1.6, draft_ms=8.0, share=0.6, accepted=2.3)
    probes = [i for i, c in enumerate(chosen) if c][policy.warmup :]
    gaps = {b - a for a, b in zip(probes, probes[1:], strict=False)}
    assert len(probes) >= 2 and gaps == {401}, probes
    time = sum(8.0 if c else 1.6 for c in chosen)
    assert time <= 2000 * 1.6 * 1.03  # the warm-up and the probes: under 3% here


def test_warmup_stops_once_drafting_cannot_pay() -> None:
    """If one drafted step costs more than 1 + max_drafts plain ones, no acceptance could
    repay it: the bucket stops drafting at once instead of after its warm-up."""
    policy = SpeculationPolicy(warmup=4, max_drafts=4)
    chosen = _feed(policy, 256, 300, plain_ms=1.6, draft_ms=8.1, share=1.0, accepted=4.0)
    # (one more drafted sample 50 steps on, then the probes spaced by their cost)
    assert chosen[:3] == [False, True, False] and sum(chosen) == 2 and chosen[53]
    # Short of it, the warm-up runs in full: 5 tokens a row could repay 4.7x.
    policy = SpeculationPolicy(warmup=4, max_drafts=4)
    chosen = _feed(policy, 256, 100, plain_ms=1.6, draft_ms=7.5, share=0.1, accepted=0.5)
    assert chosen[1:5] == [True] * 4


def test_a_bucket_times_a_plain_step_then_a_drafted_one_then_decides() -> None:
    """After the run's warm-up a new bucket takes one plain and one drafted step, then
    decides with the acceptance of every bucket's drafted steps: the last rows of a run
    pass through six buckets, and four warm-up drafted steps in each came to 24
    synchronous steps. A bucket's own acceptance takes over once it has drafted enough."""
    policy = SpeculationPolicy(warmup=4, probe_every=1000, probe_drafts_every=1000)
    assert not policy.wants_drafts(100)  # nothing timed anywhere: plain
    _feed(policy, 100, 10, plain_ms=2.0, draft_ms=3.0, share=1.0, accepted=3.0)  # pays
    # Bucket 32: its own plain step first (no other bucket's time), then one drafted step,
    # which costs more than the run's 4 tokens a row can repay: plain from then on.
    chosen = _feed(policy, 20, 30, plain_ms=1.0, draft_ms=5.0, share=0.0, accepted=0.0)
    assert chosen[:3] == [False, True, False] and sum(chosen) == 1
    # Bucket 16, where drafts pay at the run's acceptance: drafting after its plain step,
    # until the acceptance its drafts bring (none here) says otherwise.
    chosen = _feed(policy, 10, 30, plain_ms=1.0, draft_ms=2.0, share=0.0, accepted=0.0)
    assert chosen[:3] == [False, True, True]
    assert not any(chosen[2 + policy.warmup :]), chosen


def test_one_slow_step_does_not_decide_for_long() -> None:
    """A review's case: drafted steps of 11 ms giving 3 tokens a row against plain ones of
    10, but the first drafted step took 300 ms (a compile, say). It stopped the warm-up at
    once and its running mean kept the bucket plain for 2,900 steps; now the next drafting
    probe (at most ``max_probe_gap`` steps on) brings drafting back. Likewise one slow plain
    step among fast ones does not make drafting look better for more than a step or two."""
    policy = SpeculationPolicy(warmup=4, max_drafts=4)
    walls = iter([300.0])
    chosen = []
    for _ in range(3000):
        draft = policy.wants_drafts(64)
        chosen.append(draft)
        if draft:
            policy.record(StepSample(64, True, next(walls, 11.0), 64, 128))
        else:
            policy.record(StepSample(64, False, 10.0))
    first_back = chosen.index(True, 2)
    assert first_back <= policy.max_probe_gap + 2, first_back
    assert sum(chosen[first_back:]) >= 0.9 * len(chosen[first_back:])

    policy = SpeculationPolicy(warmup=1)
    _feed(policy, 8, 20, plain_ms=1.0, draft_ms=2.0, share=1.0, accepted=0.5)  # plain wins
    policy.record(StepSample(8, False, 40.0))  # one slow plain step
    assert policy.estimates()[8]["plain_ms"] == 1.0


def test_two_slow_drafted_steps_among_fast_ones_do_not_stop_drafting() -> None:
    """A review's case: drafted steps of 11 ms giving 3 tokens a row against plain ones of
    10; drafted steps 100 and 101 took 200 ms (a collection pause over two steps, say). A
    mean of the last eight but the longest kept the second and stopped drafting for 2,000
    of 6,000 steps; the longest quarter left out, drafting goes on (118 plain steps: the
    probes)."""
    policy = SpeculationPolicy(warmup=4, max_drafts=4)
    drafted, plain = 0, 0
    for _ in range(6000):
        if policy.wants_drafts(64):
            drafted += 1
            wall = 200.0 if drafted in (100, 101) else 11.0
            policy.record(StepSample(64, True, wall, 64, 128))
        else:
            plain += 1
            policy.record(StepSample(64, False, 10.0))
    assert plain < 200, plain


def test_once_nothing_waits_the_slowest_row_decides() -> None:
    """Drafting pays by the rows' mean yield (1 + 1.0 * 2 = 3 tokens a row for 1.5x the
    time), but once nothing waits the run ends with its slowest row: a row that gains
    nothing from drafts keeps the steps plain, one that gains 2.5 tokens a step does not."""
    policy = SpeculationPolicy(probe_every=1000, probe_drafts_every=1000)
    chosen = _feed(policy, 8, 50, plain_ms=10.0, draft_ms=15.0, share=1.0, accepted=2.0)
    assert all(chosen[1:])
    assert policy.wants_drafts(8) and policy.wants_drafts(8, slowest_yield=None)
    assert not policy.wants_drafts(8, slowest_yield=1.0)
    assert not policy.wants_drafts(8, slowest_yield=1.5)  # 1.5 in 1.5x the time: a tie
    assert policy.wants_drafts(8, slowest_yield=2.5)
    assert policy.wants_drafts(8, slowest_yield=4.0)  # the mean (3) bounds it


def test_two_early_misses_of_one_row_do_not_keep_the_drain_plain() -> None:
    """A row's history moves only in drafted steps: the last admitted row missing its first
    two drafts (a chat preamble) must not keep the drain plain until the next regular probe
    (50 plain steps away, most of a drain)."""
    policy = SpeculationPolicy()
    # drafting pays well: 1 + 3 = 4 tokens a row in 1.2x a plain step's time
    _feed(policy, 2, 30, plain_ms=10.0, draft_ms=12.0, share=1.0, accepted=3.0)
    # the drain: row 0 accepted nothing in its two drafted steps; from now on it copies its
    # input as row 1 does (3 of 4 drafts a step)
    slots = SimpleNamespace(drafted_steps=np.array([2, 30], dtype=np.int32),
                            accepted_drafts=np.array([0, 90], dtype=np.int64))  # fmt: skip
    scheduler = SimpleNamespace(slots=slots, _order=np.array([0, 1]))
    drafted = 0
    for _ in range(40):
        draft = policy.wants_drafts(2, Scheduler.slowest_yield(scheduler))
        if draft:
            slots.drafted_steps += 1
            slots.accepted_drafts += 3
            drafted += 1
        policy.record(StepSample(2, draft, 12.0 if draft else 10.0, 2 * draft, 6 * draft))
    assert drafted >= 30, drafted
