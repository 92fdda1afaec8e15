"""Request: one sequence's state as it moves through the scheduler and the engine.

all_token_ids:  [ prompt ............ | output ...... ]
                 ^0                    ^num_prompt_tokens
num_computed_tokens chases num_tokens: whatever lies between is what the next steps
schedule (a prefill chunk, one decode token, later speculative tokens).

With async scheduling the next step is scheduled while the GPU still samples this one, so a
request can run ahead of what the host knows:

    all_token_ids:  [ prompt | output ... ] (pending)
                                          ^num_tokens   num_pending_tokens = 1
    the next step feeds the pending token (read on the device from the step that sampled it)
    and samples the one after it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenmill.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass(eq=False)  # identity: queues find and remove a request by ``is``, not by value
class Request:
    """Mutable per-request state owned by the scheduler. Pure Python: no torch."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (stats)
    num_preemptions: int = 0
    # Tokens sampled by steps whose results the host has not read yet (async scheduling).
    num_pending_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
