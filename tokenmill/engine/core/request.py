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
from typing import TYPE_CHECKING

from tokenmill.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.core.batch_slots import BatchSlots


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the output cannot be trusted (Request.error says why)

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        )


class Request:
    """Per-request state owned by the scheduler. Pure Python: no torch.

    While the request holds a batch slot (``BatchSlots``) its tokens and step counters live in
    the slot's arrays, where a step updates all rows at once; the properties here read and
    write through to them. ``detach`` copies them back when the slot is given up. Identity
    semantics: queues find and remove a request by ``is``, not by value.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_ids",
        "arrival_index",
        "num_prompt_tokens",
        "num_cached_prompt_tokens",
        "num_preemptions",
        "status",
        "stop_reason",
        "error",
        "_tokens",
        "_num_computed",
        "_num_pending",
        "_table",
        "slot",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_index = arrival_index
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_prompt_tokens = 0  # prompt tokens served from the prefix cache (stats)
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why it finished FINISHED_ERROR
        self._tokens = list(prompt_token_ids)  # prompt + output, while detached
        self._num_computed = 0
        # Tokens sampled by steps whose results the host has not read yet (async scheduling).
        self._num_pending = 0
        self._table: BatchSlots | None = None
        self.slot = -1  # its batch slot while attached

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, slot={self.slot})"
        )

    # ---- batch slot -----------------------------------------------------------------------
    def attach(self, table: BatchSlots, slot: int) -> None:
        """Called by ``BatchSlots.add`` once it has copied this request's state in."""
        self._table, self.slot = table, slot

    def detach(self) -> None:
        """Copy the slot's state back (``BatchSlots.remove`` calls this)."""
        t, s = self._table, self.slot
        if t is None:
            return
        self._tokens = t.token_ids[s, : t.num_tokens[s]].tolist()
        self._num_computed = int(t.num_computed[s])
        self._num_pending = int(t.num_pending[s])
        self._table, self.slot = None, -1

    # ---- tokens and counters ----------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens (a copy while attached: append with append_output_token)."""
        t = self._table
        if t is None:
            return self._tokens
        return t.token_ids[self.slot, : t.num_tokens[self.slot]].tolist()

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """The tokens at positions [start, stop), copying only those while attached."""
        t = self._table
        if t is None:
            return self._tokens[start:stop]
        return t.token_ids[self.slot, start : min(stop, int(t.num_tokens[self.slot]))].tolist()

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        t = self._table
        return len(self._tokens) if t is None else int(t.num_tokens[self.slot])

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_computed_tokens(self) -> int:
        t = self._table
        return self._num_computed if t is None else int(t.num_computed[self.slot])

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        if self._table is None:
            self._num_computed = value
        else:
            self._table.num_computed[self.slot] = value

    @property
    def num_pending_tokens(self) -> int:
        t = self._table
        return self._num_pending if t is None else int(t.num_pending[self.slot])

    @num_pending_tokens.setter
    def num_pending_tokens(self, value: int) -> None:
        if self._table is None:
            self._num_pending = value
        else:
            self._table.num_pending[self.slot] = value

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def stop_token_hidden(self) -> bool:
        """Its last token ended it (an EOS or one of ``stop_token_ids``) and that token's
        text is not part of the output (unless ``include_stop_str_in_output``), as vLLM's;
        the token itself stays in ``output_token_ids``."""
        params = self.sampling_params
        if (
            self.status is not RequestStatus.FINISHED_STOPPED
            or params.include_stop_str_in_output
            or self.num_output_tokens == 0
        ):
            return False
        if isinstance(self.stop_reason, int):  # one of stop_token_ids
            return True
        last = self.token_ids_between(self.num_tokens - 1, self.num_tokens)[0]
        return self.stop_reason is None and not params.ignore_eos and last in self.eos_token_ids

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first ``num_output_tokens`` output tokens (a stop string ended the
        text before the last tokens a drafted step accepted; the request is finishing). KV
        computed for the dropped ones is no longer counted."""
        keep = self.num_prompt_tokens + num_output_tokens
        if keep >= self.num_tokens:
            return
        t = self._table
        if t is None:
            del self._tokens[keep:]
            self._num_computed = min(self._num_computed, keep)
        else:
            t.num_tokens[self.slot] = keep
            t.num_computed[self.slot] = min(int(t.num_computed[self.slot]), keep)

    def retract_output_token(self) -> None:
        """Take back the last output token of a running request, computed or not: its
        position is sampled again by the next step, which takes the token before it as its
        input (computed again; its KV is rewritten as it was). For a token sampled where a
        grammar's mask was left open and the grammar refuses (grammar_drafts.py)."""
        if self.num_output_tokens == 0:
            raise RuntimeError(f"request {self.request_id} has no output token to take back")
        keep = self.num_tokens - 1
        self.truncate_output(self.num_output_tokens - 1)
        self.num_computed_tokens = min(self.num_computed_tokens, keep - 1)

    def append_output_token(self, token_id: int) -> None:
        t = self._table
        if t is None:
            self._tokens.append(token_id)
            return
        n = t.num_tokens[self.slot]
        t.token_ids[self.slot, n] = token_id
        t.num_tokens[self.slot] = n + 1
