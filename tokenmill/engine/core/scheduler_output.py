"""Typed messages between the scheduler and the model runner.

A step is a set of batch slots (see batch_slots.py) with a range of tokens each:

    row i:  slot slots[i],  tokens [starts[i], starts[i] + num_new[i])  of that slot's request
            token_ids[slot, :num_tokens] known on the host; positions past it are pending
            (sampled by the previous step, still on the device)
    sample[i]: the step reaches the end of the request's known and pending tokens, so the
            logits of its last token pick the next one (a partial prefill chunk does not)

The arrays describe rows in scheduling order: running requests first (oldest first), then
the ones admitted this step. The runner reads ``table`` (token ids, block tables) when it
launches the step, before the next ``schedule`` changes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    """One row of a step, as objects (tests and cold paths; the hot path reads the arrays).

    all_token_ids:  [ .... computed .... | new tokens this step | rest ]
                                        ^start                ^start + num_new_tokens
    """

    request: Request
    start: int
    num_new_tokens: int
    block_ids: tuple[int, ...]
    sample: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """What one engine step computes; see the module docstring. Arrays are [B]."""

    table: BatchSlots
    slots: np.ndarray  # int64
    starts: np.ndarray  # int64
    num_new: np.ndarray  # int64
    sample: np.ndarray  # bool
    requests: np.ndarray  # object: the Request of each row
    # bool: the row computes its last token (and its drafts, if any), not a prompt chunk;
    # fixed here, since a row's draft count is cleared once its tokens are applied
    decode: np.ndarray
    # int64: the row's draft tokens this step (after its last known or pending token); a
    # row's drafts in flight from the step before are not counted here
    drafts: np.ndarray
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_rows(self) -> int:
        return len(self.slots)

    @property
    def decode_only(self) -> bool:
        """Every row is a decode row (and there is one)."""
        return bool(len(self.decode)) and bool(self.decode.all())

    @property
    def num_tokens(self) -> int:
        return int(self.num_new.sum())

    @property
    def is_empty(self) -> bool:
        return not len(self.slots)

    @property
    def scheduled(self) -> tuple[ScheduledRequest, ...]:
        """The rows as objects, block ids as the table holds them now."""
        return tuple(
            ScheduledRequest(req, int(start), int(n), self.table.block_ids(int(slot)), bool(s))
            for req, slot, start, n, s in zip(
                self.requests, self.slots, self.starts, self.num_new, self.sample, strict=True
            )
        )


def draft_summary(drafts: int, accepted: int, drafted_rows: int) -> dict[str, float]:
    """Draft counts, the share accepted, and accepted drafts per drafted row and step (each
    accepted draft is a decode step that row did not need)."""
    return {
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafts, 4) if drafts else 0.0,
        "mean_accepted_per_drafted_row": (
            round(accepted / drafted_rows, 3) if drafted_rows else 0.0
        ),
    }


@dataclass
class SchedulerStats:
    """Step counters (prefix-cache hit counts live in the KV cache manager's stats)."""

    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # drafts scheduled (multi-token steps)
    num_accepted_tokens: int = 0  # drafts the target's samples accepted
    num_drafted_rows: int = 0  # (step, row) pairs that carried at least one draft
    num_propose_calls: int = 0  # steps that asked the proposer
    propose_seconds: float = 0.0  # host time in the proposer (and writing its drafts)
    # host time the proposer spends learning: from each drafted step's samples, and from
    # finished rows' outputs (the suffix corpus, Lookahead's pool), drafting or not
    observe_seconds: float = 0.0

    def speculative(self) -> dict[str, float]:
        """``draft_summary`` of these counts, the drafted rows, and the proposer's host ms:
        per step that asked it for drafts (``propose_ms_per_step``), and all of it, learning
        included, over every step (``proposer_ms_per_step``: its share of the host's step)."""
        return {
            **draft_summary(self.num_draft_tokens, self.num_accepted_tokens, self.num_drafted_rows),
            "drafted_rows": self.num_drafted_rows,
            "propose_ms_per_step": _ms_per(self.propose_seconds, self.num_propose_calls),
            "proposer_ms_per_step": _ms_per(
                self.propose_seconds + self.observe_seconds, self.num_steps
            ),
        }


def _ms_per(seconds: float, count: int) -> float:
    return round(1e3 * seconds / count, 4) if count else 0.0


@dataclass(frozen=True)
class StepUpdate:
    """What ``Scheduler.update_from_output`` did with a step's sampled tokens."""

    finished: list[Request]  # requests that finished with this step, in no particular order
    applied: np.ndarray  # [S] bool: the token went to its request (False: it had finished)
