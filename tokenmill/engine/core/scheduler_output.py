"""Typed messages between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.core.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

        all_token_ids:  [ .... computed .... | new tokens this step | rest ]
                                            ^start                ^start + num_new_tokens

    ``sample`` is True when the step reaches the end of the request's known tokens, so the
    logits of its last scheduled token pick the next token (a partial prefill chunk does not
    sample). ``block_ids`` is the request's block table after this step's allocation.
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
    """What one engine step computes: requests in batch order."""

    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """Step counters (prefix-cache hit counts live in the KV cache manager's stats)."""

    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_preemptions: int = 0
