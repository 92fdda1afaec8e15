"""When to draft: a goodput rule that turns speculation off where it does not pay.

A drafted step gives each row 1 + its accepted drafts, but it costs more than a plain step:
more tokens through the model, the proposer's host time, and, under async scheduling with
8 rows or more, the overlap of the host's work with the device's (such drafted steps run
synchronously; smaller ones draft ahead of the step in flight, core/drafts.py, and keep
it, but their drafts are a step older). Per step the policy compares,
for the batch's size bucket (powers of two), from decode-only steps:

    plain:    B tokens                 in t_plain  (wall ms of recent plain steps)
    drafted:  B * (1 + f * m) tokens   in t_draft  (wall ms of recent drafted steps)

where f is the share of rows the proposer found drafts for and m the mean accepted drafts
per drafted row (recent drafted steps). Switching to synchronous drafted steps also leaves
the device idle while the step in flight before the first is processed, and switching back
while the next plain step is scheduled and launched (nothing in flight to overlap): t_switch,
paid once per run of drafted steps (``StepSample.switch_ms``, ``charge_switch_back``), so
spread over the ``probe_every`` drafted steps a run lasts between plain probes, and paid
in full by a drafting probe. It drafts when (1 + f * m) / (t_draft + t_switch / probe_every)
beats 1 / t_plain by ``margin``.

That is a rate of tokens, what counts while requests wait for slots. Once nothing waits
(the run's drain), the run ends when its slowest row does, and drafting finishes the rows
it can draft for early while the last rows are those nothing could be drafted for (at 256
rows of open chat on an H100, auto ran its last row alone for 20-42 plain steps and its
drain took 173 ms against off's 127: BENCHMARKS session 44). Then the policy weighs a drafted
step by the fewest tokens it gives any running row, from the rows' own history
(``Scheduler.slowest_yield``: 1 + a row's accepted drafts per drafted step it was in), in
place of 1 + f * m where that is lower. A row's history moves only in drafted steps, so
where the mean says drafting pays and only the slowest row says no, drafting is probed
again after ``slowest_probe_every`` plain steps (two early misses of the last admitted row
kept an extraction drain at 8 rows plain for 45 steps: an audit, CPU).

t_plain, t_draft and t_switch are means of a bucket's last eight samples but the longest
two (the shortest while fewer than three): a slow step or two (a collection pause, a
compile) move none for long, and steps that are often slow count as they cost.
f and m are the data's more than the batch's: until a bucket has drafted ``warmup`` steps
of its own it takes those of all buckets (a row's first tokens rarely match anything yet,
so the run drafts ``warmup`` steps before any bucket decides). A bucket times its own
plain step first (a plain step costs nothing to take), then one drafted step, then decides;
where one drafted step costs more than the most it could give (every row ``max_drafts``
tokens, all accepted), it stops at once, and probes drafting again after
``probe_drafts_every`` plain steps until it has two drafted samples. (A 1,024-row run
through 256 slots passes through six buckets as its last rows drain: a warm-up of four
synchronous drafted steps in each came to 24 of them.)

After that the mode not chosen is probed again, so the estimates follow the data and the
batch: plain every ``probe_every`` steps; drafting every ``probe_drafts_every`` plain steps,
or less often where a drafted step costs several plain ones, so that the probes' extra
time stays under ``probe_share`` of the plain steps' (at 256 rows of SmolLM2 on an H100 a
drafted step took 5x a plain one: a probe every 50 steps cost 8% of the run, BENCHMARKS
session 38), but at least every ``max_probe_gap`` plain steps. Without async scheduling a
drafted step costs little more than a plain one when few drafts come (no overlap is lost),
so the engine then probes drafting more often: which rows have drafts changes step to step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["SpeculationPolicy", "StepSample"]

_EMA = 0.2  # weight of the newest sample in the running means of f and m
_TIMES = 8  # step times a bucket keeps per mode (_Times: the estimate from them)


@dataclass(frozen=True)
class StepSample:
    """What one step did, for the policy: its batch, whether it drafted, its wall time, and
    (drafted steps) how many rows got drafts and how many drafts were accepted."""

    batch: int
    drafted: bool
    wall_ms: float
    drafted_rows: int = 0
    accepted: int = 0
    switch_ms: float = 0.0  # a drafted step's: the switch from async steps before it


class _Times:
    """A mode's last ``_TIMES`` step times: the mean of all but the longest quarter (at
    least one), or while there are fewer than 3 the shortest (a step is slowed now and
    then, by a compile or a collection pause, but never sped up: one slow first drafted
    step kept a bucket plain for 2,900 steps; two slow ones of eight, kept in a mean, for
    2,000). A mean, not the median: throughput is what the steps take on average, and at
    256 rows on an H100 a drafted step's calls took 10.4 ms on average where the median of
    five said 7.3 (drafting then cost 18-30%; BENCHMARKS session 40)."""

    def __init__(self) -> None:
        self._ms: deque[float] = deque(maxlen=_TIMES)
        self.ms: float | None = None  # the estimate, updated as times come (read every step)

    def __len__(self) -> int:
        return len(self._ms)

    def add(self, ms: float) -> None:
        self._ms.append(ms)
        self._estimate()

    def lengthen_last(self, ms: float) -> None:
        self._ms[-1] += ms
        self._estimate()

    def _estimate(self) -> None:
        if len(self._ms) < 3:
            self.ms = min(self._ms)
            return
        kept = sorted(self._ms)[: len(self._ms) - max(len(self._ms) // 4, 1)]
        self.ms = sum(kept) / len(kept)


@dataclass
class _Yield:
    """f (rows with drafts / rows) and m (accepted drafts per drafted row) of drafted steps."""

    share: float | None = None
    accepted: float | None = None
    steps: int = 0

    def add(self, sample: StepSample) -> None:
        self.steps += 1
        self.share = _mean(self.share, sample.drafted_rows / max(sample.batch, 1))
        if sample.drafted_rows:
            self.accepted = _mean(self.accepted, sample.accepted / sample.drafted_rows)
        elif self.accepted is None:
            self.accepted = 0.0

    def tokens_per_row(self) -> float:
        return 1 + (self.share or 0.0) * (self.accepted or 0.0)


@dataclass
class _Bucket:
    plain: _Times = field(default_factory=_Times)
    draft: _Times = field(default_factory=_Times)
    switch: _Times = field(default_factory=_Times)
    drafts: _Yield = field(default_factory=_Yield)
    steps: int = 0
    last_plain: int = -(10**9)
    last_draft: int = -(10**9)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


@dataclass
class SpeculationPolicy:
    """Decides per step whether to draft; ``record`` feeds it each step's outcome."""

    margin: float = 0.03
    probe_every: int = 50
    probe_drafts_every: int = 50
    probe_share: float = 0.01
    max_probe_gap: int = 1000
    warmup: int = 4
    max_drafts: int = 4  # the proposer's k: a drafted row gives at most 1 + k tokens
    slowest_probe_every: int = 8  # plain steps between drafting probes kept plain only by
    # the slowest row's history (its counters move only in drafted steps)
    _buckets: dict[int, _Bucket] = field(default_factory=dict)
    _drafts: _Yield = field(default_factory=_Yield)  # every bucket's drafted steps

    @staticmethod
    def bucket_of(batch: int) -> int:
        return 1 << max(batch - 1, 0).bit_length()  # 1, 2, 4, 8, ...

    def wants_drafts(self, batch: int, slowest_yield: float | None = None) -> bool:
        """Whether a step of ``batch`` rows drafts; ``slowest_yield``: while nothing waits,
        the fewest tokens a drafted step gives any running row (None: rows wait, or no row
        has drafted yet)."""
        b = self._bucket(batch)
        plain_ms, draft_ms = b.plain.ms, b.draft.ms
        if plain_ms is None:
            return False  # time a plain step first
        if draft_ms is None:
            return True  # then a drafted one
        if self._drafts.steps < self.warmup and not self._hopeless(draft_ms, plain_ms):
            return True  # the run's first drafted steps
        drafts = b.drafts if b.drafts.steps >= self.warmup else self._drafts
        switch_ms = b.switch.ms or 0.0
        per_step_ms = draft_ms + switch_ms / self.probe_every
        tokens = drafts.tokens_per_row()
        pays = tokens / per_step_ms - (1 + self.margin) / plain_ms > 0
        if slowest_yield is not None:
            tokens = min(tokens, slowest_yield)
        gain = tokens / per_step_ms - (1 + self.margin) / plain_ms
        if gain > 0:
            return b.steps - b.last_plain < self.probe_every
        if pays:  # only the slowest row's (frozen) history says no: look again soon
            return b.steps - b.last_draft > self.slowest_probe_every
        if len(b.draft) < 2:  # one drafted sample decides nothing for long
            return b.steps - b.last_draft > self.probe_drafts_every
        interval = self._draft_probe_interval(draft_ms + switch_ms, plain_ms)
        return b.steps - b.last_draft >= interval

    def _hopeless(self, draft_ms: float, plain_ms: float) -> bool:
        """Whether drafted steps cost more than the most they could give."""
        return (1 + self.max_drafts) / draft_ms <= (1 + self.margin) / plain_ms

    def _draft_probe_interval(self, probe_ms: float, plain_ms: float) -> int:
        """Plain steps between two drafting probes: a probe's extra time (a drafted step and
        the switches to it and back, less a plain step) over the plain steps between probes
        stays under probe_share."""
        wanted = math.ceil((probe_ms / plain_ms - 1) / self.probe_share)
        return min(max(self.probe_drafts_every, wanted), self.max_probe_gap)

    def _bucket(self, batch: int) -> _Bucket:
        """``batch``'s bucket, made on first use (not a throwaway one a call: ~1/3 of the
        policy's host time a step, CPU)."""
        size = self.bucket_of(batch)
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = self._buckets[size] = _Bucket()
        return bucket

    def record(self, sample: StepSample) -> None:
        b = self._bucket(sample.batch)
        b.steps += 1
        if not sample.drafted:
            b.plain.add(sample.wall_ms)
            b.last_plain = b.steps
            return
        b.draft.add(sample.wall_ms)
        if sample.switch_ms:
            b.switch.add(sample.switch_ms)
        b.drafts.add(sample)
        self._drafts.add(sample)
        b.last_draft = b.steps

    def charge_switch_back(self, batch: int, wall_ms: float) -> None:
        """The first plain step after a synchronous drafted one is scheduled and launched
        with the device idle (nothing in flight to overlap): ``wall_ms`` of that is a cost
        of the switch (``batch``: the drafted step's rows), added to the switch to drafting
        that began the run of drafted steps."""
        b = self._buckets.get(self.bucket_of(batch))
        if b is None or b.draft.ms is None:
            return
        if len(b.switch):
            b.switch.lengthen_last(wall_ms)
        else:
            b.switch.add(wall_ms)

    def estimates(self) -> dict[int, dict[str, float | None]]:
        """Per batch bucket: mean plain and drafted step ms, f and m (for the step profile)."""
        return {
            size: {
                "plain_ms": b.plain.ms,
                "draft_ms": b.draft.ms,
                "switch_ms": b.switch.ms,
                "drafted_share": b.drafts.share,
                "accepted_per_drafted_row": b.drafts.accepted,
            }
            for size, b in sorted(self._buckets.items())
        }
