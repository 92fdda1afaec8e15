"""When to draft: a goodput rule that turns speculation off where it does not pay.

A drafted step gives each row 1 + its accepted drafts, but it costs more than a plain step:
more tokens through the model, the proposer's host time, and, under async scheduling with
8 rows or more, the overlap of the host's work with the device's (such drafted steps run
synchronously; smaller ones draft ahead of the step in flight, core/drafts.py, and keep
it, but their drafts are a step older). Per step the policy compares,
for the batch's size bucket (powers of two), from decode-only steps:

    plain:    B tokens                 in t_plain  (mean wall ms of recent plain steps)
    drafted:  B * (1 + f * m) tokens   in t_draft  (mean wall ms of recent drafted steps)

where f is the share of rows the proposer found drafts for and m the mean accepted drafts
per drafted row (recent drafted steps). A synchronous drafted step also leaves the device
idle while the next plain step is scheduled and launched (nothing in flight to overlap):
that time is charged to t_draft (``charge_switch_back``). It drafts when
(1 + f * m) / t_draft beats 1 / t_plain by ``margin``.

A bucket first times a plain step (or borrows the plain time of a larger bucket: a smaller
batch's plain step is no longer), then drafts for ``warmup`` decode steps (a row's first
tokens rarely match anything yet) unless one drafted step already shows that drafting
cannot pay even if every row drafted ``max_drafts`` tokens and all were accepted. After
that the mode not chosen is probed again, so the estimates follow the data and the batch:
plain every ``probe_every`` steps; drafting every ``probe_drafts_every`` plain steps, or
less often where a drafted step costs several plain ones, so that the probes' extra time
stays under ``probe_share`` of the plain steps' (at 256 rows of SmolLM2 on an H100 a
drafted step took 5x a plain one: a probe every 50 steps cost 8% of the run, BENCHMARKS
session 38). Without async scheduling a drafted step costs little more than a plain one
when few drafts come (no overlap is lost), so the engine then probes drafting more often:
which rows have drafts changes step to step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["SpeculationPolicy", "StepSample"]

_EMA = 0.2  # weight of the newest sample in the running means


@dataclass(frozen=True)
class StepSample:
    """What one step did, for the policy: its batch, whether it drafted, its wall time, and
    (drafted steps) how many rows got drafts and how many drafts were accepted."""

    batch: int
    drafted: bool
    wall_ms: float
    drafted_rows: int = 0
    accepted: int = 0


@dataclass
class _Bucket:
    plain_ms: float | None = None
    draft_ms: float | None = None
    share: float | None = None  # f: rows with drafts / rows, in drafted steps
    accepted: float | None = None  # m: accepted drafts per drafted row
    drafted_steps: int = 0
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
    warmup: int = 4
    max_drafts: int = 4  # the proposer's k: a drafted row gives at most 1 + k tokens
    _buckets: dict[int, _Bucket] = field(default_factory=dict)

    @staticmethod
    def bucket_of(batch: int) -> int:
        return 1 << max(batch - 1, 0).bit_length()  # 1, 2, 4, 8, ...

    def wants_drafts(self, batch: int) -> bool:
        size = self.bucket_of(batch)
        b = self._buckets.setdefault(size, _Bucket())
        plain_ms = self._plain_ms(size)
        if plain_ms is None:
            return False  # time a plain step first
        if b.drafted_steps < self.warmup and not self._hopeless(b, plain_ms):
            return True
        if b.plain_ms is None:
            return False
        gain = (1 + b.share * b.accepted) / b.draft_ms - (1 + self.margin) / b.plain_ms
        drafting = gain > 0
        if drafting:
            return b.steps - b.last_plain < self.probe_every
        return b.steps - b.last_draft >= self._draft_probe_interval(b)

    def _plain_ms(self, size: int) -> float | None:
        """The bucket's plain step time, else the nearest larger bucket's (an upper bound)."""
        for s, b in sorted(self._buckets.items()):
            if s >= size and b.plain_ms is not None:
                return b.plain_ms
        return None

    def _hopeless(self, b: _Bucket, plain_ms: float) -> bool:
        """Whether the bucket's drafted steps cost more than the most they could give."""
        if b.draft_ms is None:
            return False
        return (1 + self.max_drafts) / b.draft_ms <= (1 + self.margin) / plain_ms

    def _draft_probe_interval(self, b: _Bucket) -> int:
        """Plain steps between two drafting probes: a probe's extra time (a drafted step
        less a plain one) over the plain steps between probes stays under probe_share."""
        excess = b.draft_ms / b.plain_ms - 1 if b.draft_ms is not None else 0.0
        return max(self.probe_drafts_every, math.ceil(excess / self.probe_share))

    def record(self, sample: StepSample) -> None:
        b = self._buckets.setdefault(self.bucket_of(sample.batch), _Bucket())
        b.steps += 1
        if not sample.drafted:
            b.plain_ms = _mean(b.plain_ms, sample.wall_ms)
            b.last_plain = b.steps
            return
        b.drafted_steps += 1
        b.draft_ms = _mean(b.draft_ms, sample.wall_ms)
        b.share = _mean(b.share, sample.drafted_rows / max(sample.batch, 1))
        if sample.drafted_rows:
            b.accepted = _mean(b.accepted, sample.accepted / sample.drafted_rows)
        elif b.accepted is None:
            b.accepted = 0.0
        b.last_draft = b.steps

    def charge_switch_back(self, batch: int, wall_ms: float) -> None:
        """The first plain step after a synchronous drafted one is scheduled and launched
        with the device idle (nothing in flight to overlap): ``wall_ms`` of that is the
        drafted step's cost (``batch``: that step's rows), added to its bucket's drafted
        mean as if its sample (the newest) had been that much longer."""
        b = self._buckets.get(self.bucket_of(batch))
        if b is not None and b.draft_ms is not None:
            b.draft_ms += wall_ms if b.drafted_steps == 1 else _EMA * wall_ms  # (_mean)

    def estimates(self) -> dict[int, dict[str, float | None]]:
        """Per batch bucket: mean plain and drafted step ms, f and m (for the step profile)."""
        return {
            size: {
                "plain_ms": b.plain_ms,
                "draft_ms": b.draft_ms,
                "drafted_share": b.share,
                "accepted_per_drafted_row": b.accepted,
            }
            for size, b in sorted(self._buckets.items())
        }
