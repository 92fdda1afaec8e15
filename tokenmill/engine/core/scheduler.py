"""Step scheduler: continuous batching under one token budget per step.

Each step walks the running requests first (decode tokens, the rest of a chunked prefill),
then admits waiting ones in arrival order (FCFS) while the budget, ``max_num_seqs`` and free
KV blocks allow. A request asks for ``num_tokens - num_computed_tokens`` tokens; prefix-cache
hits, chunked prefill and (later) speculative tokens all just move ``num_computed_tokens``.

When a running request cannot get a block, the most recently admitted running request is
preempted by recompute: its blocks are freed, ``num_computed_tokens`` drops to 0 and it goes
back to the front of the queue, keeping the tokens it has generated.

With ``async_scheduling`` step n+1 is scheduled before step n's sampled tokens are read:
every request that samples in a step gets a pending token (``Request.num_pending_tokens``),
which the next step already schedules as its input. A request whose pending token will end it
by length (``max_tokens``, ``max_model_len``) is not scheduled again; one that turns out to
stop on EOS or a stop string has computed one token too many, which is dropped.

Pure Python: no torch, so it is tested on CPU with tiny block sizes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from tokenmill.engine.core import KVCacheManager
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.core.scheduler_output import (
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step. Raises ValueError naming the key when out of range."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


class Scheduler:
    """Owns the request queues and the KV cache manager; see the module docstring."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    # ---- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id}: {request.num_tokens} prompt tokens leave no room "
                f"to generate within max_model_len={self.config.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (stop strings, aborts) and free their blocks."""
        ids = set(request_ids)
        for req in [r for r in self.running if r.request_id in ids]:
            self.running.remove(req)
            self._finish(req, status)
        for req in [r for r in self.waiting if r.request_id in ids]:
            self.waiting.remove(req)
            self._finish(req, status)

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        # Running requests first, oldest first; preempt from the newest end on KV pressure.
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            num_new = min(self._num_known(req) - req.num_computed_tokens, budget)
            if num_new <= 0 or self._ends_when_pending_lands(req):
                idx += 1
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append(self._scheduled(req, num_new))
                budget -= num_new
                idx += 1
                continue
            break  # `req` itself was preempted: nothing after it can be scheduled either

        # Then admit waiting requests in FCFS order.
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                if req.num_pending_tokens:
                    break  # preempted with a token in flight: wait until it lands
                hit_blocks, hit_tokens = self._prefix_hit(req)
                num_new = min(req.num_tokens - req.num_computed_tokens - hit_tokens, budget)
                if not self.kv.allocate_slots(req, num_new, hit_blocks):
                    break
                self.waiting.popleft()
                if hit_tokens:
                    req.num_computed_tokens += hit_tokens
                    if req.num_computed_tokens <= req.num_prompt_tokens:
                        req.num_cached_prompt_tokens = max(
                            req.num_cached_prompt_tokens, req.num_computed_tokens
                        )
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled.append(self._scheduled(req, num_new))
                budget -= num_new

        out = SchedulerOutput(scheduled=tuple(scheduled), preempted_ids=tuple(preempted))
        self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += out.num_tokens
        return out

    @staticmethod
    def _num_known(req: Request) -> int:
        """Tokens the next step may compute: the known ones and the pending ones."""
        return req.num_tokens + req.num_pending_tokens

    def _ends_when_pending_lands(self, req: Request) -> bool:
        if not req.num_pending_tokens:
            return False
        outputs = req.num_output_tokens + req.num_pending_tokens
        return (
            outputs >= req.sampling_params.max_tokens
            or self._num_known(req) >= self.config.max_model_len
        )

    def _prefix_hit(self, req: Request) -> tuple[list[int], int]:
        if req.num_computed_tokens:
            return [], 0
        return self.kv.get_computed_blocks(req)

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        req.num_computed_tokens += num_new
        # Cache at schedule time: each layer stores the step's K/V before any attention
        # reads, so requests admitted later in this same step may already share these blocks.
        # Only blocks of known tokens: a pending token's id is not on the host yet.
        self.kv.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens))
        sample = req.num_computed_tokens == self._num_known(req)
        if sample and self.config.async_scheduling:
            req.num_pending_tokens += 1
        return ScheduledRequest(
            request=req,
            start=start,
            num_new_tokens=num_new,
            block_ids=tuple(self.kv.block_ids(req.request_id)),
            sample=sample,
        )

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.stats.num_preemptions += 1

    # ---- after the model ran ------------------------------------------------------------
    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[Request]:
        """Append sampled tokens, apply stop rules, free finished requests.

        ``sampled`` maps request id to the tokens accepted this step (one without
        speculation). Returns the requests that finished this step.

        With async scheduling a request may have been preempted since this step ran (it was
        computed on intact blocks, so its token stands) or finished (its token is dropped).
        """
        finished: list[Request] = []
        for item in output.scheduled:
            req = item.request
            if item.sample and self.config.async_scheduling:
                req.num_pending_tokens -= 1
            if req.finished:
                continue
            status_before = req.status
            for token in sampled.get(req.request_id, ()):
                req.append_output_token(token)
                status = self._stop_status(req, token)
                if status is not None:
                    req.status = status
                    break
            if req.finished:
                preempted = status_before is RequestStatus.PREEMPTED
                (self.waiting if preempted else self.running).remove(req)
                self._finish(req, req.status)
                finished.append(req)
        return finished

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
