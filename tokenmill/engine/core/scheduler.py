"""Step scheduler: continuous batching under one token budget per step.

Each step walks the running requests first (decode tokens, the rest of a chunked prefill),
then admits waiting ones in arrival order (FCFS) while the budget, ``max_num_seqs`` and free
KV blocks allow. A request asks for ``num_tokens - num_computed_tokens`` tokens; prefix-cache
hits, chunked prefill and (later) speculative tokens all just move ``num_computed_tokens``.

With CUDA graphs the engine sets ``admit_batch`` (max_num_seqs / 8): while requests run,
waiting ones are admitted only once that many slots are free, so the steps that prefill
(which run eagerly) are few and the decode-only steps between them replay graphs. On the
H200 with natural-EOS chat prompts this took SmolLM2 from 26k to 92-94k tok/s.

When a running request cannot get a block, the most recently admitted running request is
preempted by recompute: its blocks are freed, ``num_computed_tokens`` drops to 0 and it goes
back to the front of the queue, keeping the tokens it has generated.

With ``async_scheduling`` step n+1 is scheduled before step n's sampled tokens are read:
every request that samples in a step gets a pending token (``Request.num_pending_tokens``),
which the next step already schedules as its input. A request whose pending token will end it
by length (``max_tokens``, ``max_model_len``) is not scheduled again; one that turns out to
stop on EOS or a stop string has computed one token too many, which is dropped.

The running requests hold batch slots (batch_slots.py): a plain decode step is scheduled
and updated with numpy over all slots at once; Python touches only the rows that change (a
new KV block, a newly full block for the prefix cache, a finished or admitted request). Under
KV pressure, or when the running rows need more than the token budget, a per-request loop
decides preemptions and chunks.

Numpy, no torch: it is tested on CPU with tiny block sizes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.drafts import (
    DraftProposer,
    ObservesSamples,
    PredictsAhead,
    add_drafts,
    install_ahead,
    may_draft,
    verify_drafts,
)
from tokenmill.engine.core.kv_cache_manager import KVCacheManager
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.core.scheduler_output import SchedulerOutput, SchedulerStats, StepUpdate
from tokenmill.engine.core.token_append import RowEnds, append_tokens, stop_rules, tokens_by_row


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step, resolved by the engine from its EngineConfig (which owns the
    settings and their defaults). Raises ValueError naming the key when out of range."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int  # the engine's resolved context, not the setting (may be None there)
    async_scheduling: bool = False  # resolved for the device
    # While requests run, admit waiting ones only once this many (or all that wait) fit:
    # steps that prefill are fewer and larger, and the decode-only steps between them replay
    # CUDA graphs. 1: admit whenever a slot is free.
    admit_batch: int = 1
    # With async scheduling and a proposer that predicts ahead: rows with a step in flight
    # draft too (drafts.py), so drafted steps need not wait for the one before.
    drafts_ahead: bool = False
    # Whether rows with a grammar take drafts. Off under the ``auto`` policy: a constrained
    # drafted step walks the grammar once per draft and masks 1 + k logits rows a row, and
    # on an H100 it lost at 8 and 64 rows (suffix 0.94x / 0.88x of off on a structured job,
    # BENCHMARKS.md session 49), so auto leaves them plain and an all-constrained batch
    # never switches to drafted steps.
    constrained_drafts: bool = True

    def __post_init__(self) -> None:
        for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "admit_batch"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")


class Scheduler:
    """Owns the request queues, the batch slots and the KV cache manager; see the module
    docstring."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        proposer: DraftProposer | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.proposer = proposer
        # a runtime Protocol check costs ~9 us: once here, not every drafted step
        self._observer = proposer if isinstance(proposer, ObservesSamples) else None
        if config.drafts_ahead and not (
            config.async_scheduling and isinstance(proposer, PredictsAhead)
        ):
            raise ValueError(
                "drafts_ahead needs async_scheduling and a proposer that predicts ahead"
            )
        width = 2 * proposer.max_drafts if config.drafts_ahead else 0
        self.slots = BatchSlots(
            config.max_num_seqs, config.max_model_len, kv_manager.block_size, width
        )
        self.waiting: deque[Request] = deque()
        self._order = np.empty(0, dtype=np.int64)  # running slots, oldest admission first
        self.stats = SchedulerStats()

    # ---- queue management -------------------------------------------------------------
    @property
    def running(self) -> list[Request]:
        """The running requests, oldest first (a new list)."""
        return self.slots.requests[self._order].tolist()

    def add_request(self, request: Request) -> None:
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id}: {request.num_tokens} prompt tokens leave no room "
                f"to generate within max_model_len={self.config.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def clear(self) -> None:
        """Forget every request: the queue, the running order, every batch slot and KV
        block, and the prefix cache (``KVCacheManager.clear``). For a call cut short, whose
        interrupt may have left a request holding a slot or blocks outside the running
        order (``_admit`` gives slots before the order takes the requests; the order drops
        ended rows before they are retired)."""
        for slot, request in enumerate(self.slots.requests):
            if request is not None:
                self.slots.remove(slot)
        self.waiting.clear()
        self._order = self._order[:0]
        self.kv.clear()

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(len(self._order))

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self._order)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests by id from outside (aborts; unknown or finished ids are ignored)
        and free their blocks, as ``finish``. Walks the running rows, and the queue for
        ids not among them."""
        ids = set(request_ids)
        found = [r for r in self.running if r.request_id in ids]
        ids.difference_update(r.request_id for r in found)
        if ids:  # the queue, thousands long in a batch job, only when some are not running
            found += [r for r in self.waiting if r.request_id in ids]
        self.finish(found, status)

    def finish(self, requests: Sequence[Request], status: RequestStatus) -> None:
        """Finish ``requests`` from outside (a grammar or a stop string ended them; finished
        ones are ignored) and free their blocks: the running ones in their admission order,
        then the waiting ones in queue order. Python runs per request given, not per running
        row: the engine holds the requests, and walking 512 running rows to find them by id
        cost a structured decode step ~35 us of the engine thread (CPU)."""
        ended = self._drop_running([r.slot for r in requests if r.slot >= 0])
        for slot in ended.tolist():
            self._retire(self.slots.requests[slot], status)
        waiting = {r for r in requests if r.slot < 0 and not r.finished}
        if not waiting:  # the common case (a grammar or stop string ended running rows):
            return  # the queue, thousands long in a batch job, is not walked
        for req in [r for r in self.waiting if r in waiting]:
            self.waiting.remove(req)
            self._retire(req, status)

    def uncount_accepted(self, req: Request, num_tokens: int) -> None:
        """Take back ``num_tokens`` drafts counted as accepted for ``req``: a stop string
        completed mid-step cut them off its output (``Request.truncate_output``), so, as the
        ones past an EOS or stop id (``update_from_output``), they saved no step. Call it
        before the request finishes, while its slot still holds its yield."""
        self.stats.num_accepted_tokens -= num_tokens
        if req.slot >= 0:
            self.slots.accepted_drafts[req.slot] -= num_tokens

    # ---- one step ---------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._order)

    def can_draft(self) -> bool:
        """Whether a running row may take drafts at all: rows that ask for logprobs never do
        (core/drafts.py), nor rows with a grammar without ``constrained_drafts``, so a batch
        of only those gains nothing from a drafted step and would only lose its overlap
        with the device."""
        cols = self.slots.sampling.columns
        return bool(may_draft(cols, self._order, self.config.constrained_drafts).any())

    def slowest_yield(self, min_steps: int = 2) -> float | None:
        """The fewest tokens a drafted step gives any running row, by the rows' own history:
        1 + accepted drafts per drafted step it was in, over rows in at least ``min_steps``
        of them; None when no row has that history. While nothing waits, the run ends with
        its slowest rows: the speculation policy weighs a drafted step by this, not by the
        mean yield (engine/spec_decode/policy.py)."""
        steps = self.slots.drafted_steps[self._order]
        seen = steps >= min_steps
        if not seen.any():
            return None
        accepted = self.slots.accepted_drafts[self._order][seen]
        return 1.0 + float((accepted / steps[seen]).min())

    def schedule(self, draft: bool = True, ahead: bool | None = None) -> SchedulerOutput:
        """The next step. ``draft``: decode rows whose inputs are all known on the host take
        the proposer's drafts, and with ``ahead`` (default: ``drafts_ahead``; only where
        that is on) so do rows with a step in flight, drafted ahead of it (drafts.py)."""
        budget = self.config.max_num_batched_tokens
        ahead = self.config.drafts_ahead if ahead is None else ahead and self.config.drafts_ahead
        # Drafts take only the budget that the prompts this step admits leave: a prompt's
        # token is work done for sure, a draft only if accepted (drafts had taken the budget
        # from them, so admissions took more prefill steps).
        draft_budget = budget - self._admission_tokens(budget) if draft else budget
        slots, num_new, drafts, preempted = self._schedule_running(
            budget, draft and draft_budget > 0, ahead, draft_budget
        )
        starts, sample = self._advance(slots, num_new)
        parts = [(slots, starts, num_new, sample, drafts)]
        if not preempted:
            parts += self._admit(budget - int(num_new.sum()))
        slots, starts, num_new, sample, drafts = (
            np.concatenate(col) for col in zip(*parts, strict=True)
        )
        out = SchedulerOutput(
            table=self.slots,
            slots=slots,
            starts=starts,
            num_new=num_new,
            sample=sample,
            requests=self.slots.requests[slots],
            # a tree's tokens are not one chain: its row attends like a prefill chunk
            decode=(num_new == 1 + drafts) & ~self.slots.draft_tree[slots],
            drafts=drafts,
            preempted_ids=tuple(preempted),
        )
        self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += out.num_tokens
        return out

    def _schedule_running(
        self, budget: int, draft: bool, ahead: bool, draft_budget: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
        """Slots of the running requests this step serves, their token counts and drafts
        (within ``draft_budget``), oldest first, with their KV slots allocated; plus the
        ids preempted to make room.

        Vectorized when every running request fits the budget and the free blocks; the
        per-request loop (``_schedule_running_loop``) otherwise. A row's drafts in flight
        (drafted ahead, drafts.py) count as known: its step starts where they all land.
        """
        s, order = self.slots, self._order
        computed = s.num_computed[order].astype(np.int64)
        known = s.num_tokens[order].astype(np.int64) + s.num_pending[order] + s.num_drafts[order]
        num_new = np.maximum(known - computed, 0)
        if self.config.async_scheduling:
            num_new[self._ends_when_pending_lands(order)] = 0
        drafts = np.zeros(len(order), dtype=np.int64)
        if self.proposer is not None and draft:
            t0 = time.perf_counter()
            drafts = add_drafts(
                s, order, num_new, self.proposer, draft_budget, self.config.max_model_len,
                ahead=ahead, constrained=self.config.constrained_drafts,
            )  # fmt: skip
            self.stats.propose_seconds += time.perf_counter() - t0
            self.stats.num_propose_calls += 1
            num_new += drafts
        bs = self.kv.block_size
        need = -(-(computed + num_new) // bs) - s.num_blocks[order]
        grow = np.flatnonzero((need > 0) & (num_new > 0))
        if num_new.sum() > budget or need[grow].sum() > self.kv.num_free_blocks:
            own = s.num_pending[order] == 0  # this step's drafts (not ones in flight)
            s.num_drafts[order[own]] = 0
            s.draft_tree[order] = False
            s.num_ahead[order] = 0
            return self._schedule_running_loop(budget)
        if len(grow):  # the rows that start a new block: 1 in block_size decodes
            self._append_blocks(order[grow], need[grow])
        if self.proposer is not None and draft:
            self.stats.num_draft_tokens += int(drafts.sum())
            self.stats.num_drafted_rows += int(np.count_nonzero(drafts))
        keep = num_new > 0
        return order[keep], num_new[keep], drafts[keep], []

    def _schedule_running_loop(
        self, budget: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
        """The running rows one by one: clip to the budget, preempt the newest on KV pressure.
        Rows with drafts in flight sit this step out (their start is the device's until
        those land) and are never preempted mid-draft."""
        s = self.slots
        waits = s.num_drafts[self._order] > 0
        order = self._order[~waits].tolist()
        slots: list[int] = []
        counts: list[int] = []
        preempted: list[str] = []
        victims: list[int] = []
        idx = 0
        while idx < len(order) and budget > 0:
            slot = order[idx]
            req = s.requests[slot]
            num_new = min(req.num_tokens + req.num_pending_tokens - req.num_computed_tokens, budget)
            if num_new <= 0 or self._ends_when_pending_lands(np.array([slot]))[0]:
                idx += 1
                continue
            while not self.kv.allocate_slots(req, num_new):
                victims.append(order.pop())
                victim = s.requests[victims[-1]]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                self._sync_blocks(slot)
                slots.append(slot)
                counts.append(num_new)
                budget -= num_new
                idx += 1
                continue
            break  # `req` itself was preempted: nothing after it can be scheduled either
        self._order = self._order[~np.isin(self._order, victims)]
        scheduled = np.asarray(slots, dtype=np.int64)
        counts_arr = np.asarray(counts, dtype=np.int64)
        return scheduled, counts_arr, np.zeros(len(slots), dtype=np.int64), preempted

    def _append_blocks(self, slots: np.ndarray, counts: np.ndarray) -> None:
        """Give running rows ``counts`` more blocks each, in the KV manager and the block
        table, in one call each (not one per row: at 512 rows a decode step grows ~32)."""
        s = self.slots
        ids = self.kv.append_blocks(s.requests[slots].tolist(), counts.tolist())
        held = s.num_blocks[slots]
        # new block k of row i goes to column held[i] + k: ids are row after row
        rows = np.repeat(slots, counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        s.block_table[rows, np.repeat(held, counts) + np.arange(len(ids)) - first] = ids
        s.num_blocks[slots] = held + counts

    def _ends_when_pending_lands(self, slots: np.ndarray) -> np.ndarray:
        """[R] bool: the row's pending token will end it by length, so it is not scheduled."""
        s = self.slots
        if not self.config.async_scheduling:
            return np.zeros(len(slots), dtype=np.bool_)
        known = s.num_tokens[slots].astype(np.int64) + s.num_pending[slots]
        outputs = known - s.num_prompt[slots]
        return (s.num_pending[slots] > 0) & (
            (outputs >= s.max_tokens[slots]) | (known >= self.config.max_model_len)
        )

    def _admission_tokens(self, budget: int) -> int:
        """The prompt tokens the waiting requests this step will admit may take: theirs, up
        to ``budget`` and to what the free KV blocks hold (a full cache admits nothing: its
        free slots must not stop the running rows' drafts), with slots free
        (``_admits_next``); 0 when it admits none. Prefix-cache hits are not looked up: a
        prompt found cached takes less, and that step's drafts less than they could."""
        if self.proposer is None or not self._admits_next():
            return 0
        limit = min(budget, self.kv.num_free_blocks * self.kv.block_size)
        tokens = 0
        for req in islice(self.waiting, self.config.max_num_seqs - len(self._order)):
            tokens += req.num_tokens - req.num_computed_tokens
            if tokens >= limit:
                return limit
        return tokens

    def _admits_next(self) -> bool:
        """Whether the next step admits waiting requests (slots and blocks allowing): some
        wait, and a slot is free, or ``admit_batch`` are while requests run."""
        free = self.config.max_num_seqs - len(self._order)
        if not self.waiting or free <= 0 or self.waiting[0].num_pending_tokens:
            return False
        return not (len(self._order) and free < min(self.config.admit_batch, len(self.waiting)))

    def _admit(self, budget: int) -> list[tuple[np.ndarray, ...]]:
        """Admit waiting requests in FCFS order while budget, slots and blocks allow; each
        one's full blocks are cached before the next looks up the prefix cache, then all take
        their slots in one pass (``BatchSlots.add_many``) and are advanced together."""
        s = self.slots
        admitted: list[Request] = []
        counts: list[int] = []
        cached: list[int] = []  # full blocks each one's admission cached
        if not self._admits_next():
            return []
        while (
            self.waiting
            and budget > 0
            and len(self._order) + len(admitted) < self.config.max_num_seqs
        ):
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
            # before the next request looks the prefix cache up (it may share these blocks)
            cached.append(self._cache_blocks_of(req, req.num_computed_tokens + num_new, 0))
            admitted.append(req)
            counts.append(num_new)
            budget -= num_new
        if not admitted:
            return []
        rows = s.add_many(admitted)  # the slots, written in one pass
        s.num_cached_full[rows] = cached
        for slot in rows.tolist():
            self._sync_blocks(slot)
        num_new_rows = np.asarray(counts, dtype=np.int64)
        starts, sample = self._advance(rows, num_new_rows)  # their blocks are cached already
        self._order = np.concatenate([self._order, rows])
        return [(rows, starts, num_new_rows, sample, np.zeros(len(rows), dtype=np.int64))]

    def _advance(self, slots: np.ndarray, num_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Move the rows' computed tokens on by ``num_new``; return (starts, sample) [R].

        Caches newly full prompt blocks at schedule time: each layer stores the step's K/V
        before any attention reads, so requests admitted later in this same step may already
        share them. Blocks of output tokens are cached when the request leaves its slot
        (finished or preempted: ``_release``): until then only a prompt
        that repeats this one's output could use them, and offering each row's block as it
        fills cost a decode step ~26 Python calls at 420 rows (the engine thread's time,
        which a constrained step waits on). Only blocks of known tokens: a pending token's
        id is not on the host yet.
        """
        s = self.slots
        starts = s.num_computed[slots].astype(np.int64)
        computed = starts + num_new
        s.num_computed[slots] = computed
        known = s.num_tokens[slots].astype(np.int64)
        if self.kv.enable_prefix_caching:
            cacheable = np.minimum(np.minimum(computed, known), s.num_prompt[slots])
            full = cacheable // self.kv.block_size
            for i in np.flatnonzero(full > s.num_cached_full[slots]).tolist():
                self._offer_blocks(int(slots[i]), int(cacheable[i]), int(full[i]))
        sample = computed == known + s.num_pending[slots] + s.num_drafts[slots] + s.num_ahead[slots]
        if self.config.async_scheduling:
            s.num_pending[slots[sample]] += 1
        return starts, sample

    def _cache_blocks_of(self, req: Request, computed: int, cached_full: int) -> int:
        """Offer the prefix cache the request's blocks that ``computed`` tokens fill, of
        known tokens only (a pending token's id is not on the host yet), where that is more
        than the ``cached_full`` blocks it cached before; returns its full blocks cached
        now (a slot's ``num_cached_full``)."""
        if not self.kv.enable_prefix_caching:
            return cached_full
        cacheable = min(computed, req.num_tokens)
        full = cacheable // self.kv.block_size
        if full <= cached_full:
            return cached_full
        self.kv.cache_blocks(req, cacheable)
        return full

    def _offer_blocks(self, slot: int, cacheable: int, full: int) -> None:
        """Cache the slot's first ``cacheable`` tokens' ``full`` blocks (more than it has
        cached)."""
        self.kv.cache_blocks(self.slots.requests[slot], cacheable)
        self.slots.num_cached_full[slot] = full

    def _prefix_hit(self, req: Request) -> tuple[list[int], int]:
        # Prompt logprobs need every prompt position's logits: cached ones have none.
        if req.num_computed_tokens or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        return self.kv.get_computed_blocks(req)

    def _sync_blocks(self, slot: int) -> None:
        """Copy the blocks the KV manager added to the slot's request into its table row."""
        held = int(self.slots.num_blocks[slot])
        new = self.kv.block_ids(self.slots.requests[slot].request_id, held)
        if new:
            self.slots.set_blocks(slot, new, held)

    def _preempt(self, req: Request) -> None:
        self._release(req)  # its output's blocks cached first: the recompute finds them
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.stats.num_preemptions += 1

    # ---- after the model ran ------------------------------------------------------------
    def update_from_output(
        self,
        output: SchedulerOutput,
        rows: np.ndarray,
        token_ids: np.ndarray,
        counts: np.ndarray | None = None,
    ) -> StepUpdate:
        """Append sampled tokens, verify drafts, apply stop rules, free finished requests.

        ``rows`` [S] are indices into ``output``'s rows; row ``rows[i]`` sampled ``counts[i]``
        tokens (default 1 each), laid out one row after another in ``token_ids``. A row with
        drafts sampled 1 + k: it keeps the tokens up to the first draft its samples reject
        (see drafts.py). With async scheduling a request may have been preempted since this
        step ran (it was computed on intact blocks, so its token stands) or finished (its
        token is dropped).
        """
        s = self.slots
        rows = np.asarray(rows, dtype=np.int64)
        token_ids = np.asarray(token_ids, dtype=np.int64)
        counts = np.ones(len(rows), dtype=np.int64) if counts is None else np.asarray(counts)
        first = np.cumsum(counts) - counts  # [S] each row's first token in ``token_ids``
        sampled = np.flatnonzero(output.sample)
        # Still in the slot it ran in: the common case, done on arrays.
        attached = np.zeros(output.num_rows, dtype=np.bool_)
        attached[sampled] = s.requests[output.slots[sampled]] == output.requests[sampled]
        if self.config.async_scheduling:
            s.num_pending[output.slots[sampled[attached[sampled]]]] -= 1
            for i in sampled[~attached[sampled]].tolist():
                output.requests[i].num_pending_tokens -= 1
        finished: list[Request] = []
        applied = attached[rows]
        for k in np.flatnonzero(~applied).tolist():  # preempted since (or finished: dropped)
            req = output.requests[rows[k]]
            if not req.finished:
                if counts[k] != 1:
                    raise RuntimeError(f"request {req.request_id} lost its slot mid-draft")
                applied[k] = True
                if self._append_detached(req, int(token_ids[first[k]])):
                    finished.append(req)
        hot = np.flatnonzero(attached[rows])
        slots = output.slots[rows[hot]]
        tokens = tokens_by_row(token_ids, first[hot], counts[hot])  # [R, M]
        keep = counts[hot]
        accepted = np.zeros(len(hot), dtype=np.int64)
        drafted = tokens.shape[1] > 1
        if drafted:
            if self._observer is not None:
                t0 = time.perf_counter()
                self._observer.observe_samples(s, slots, tokens, keep)
                self.stats.observe_seconds += time.perf_counter() - t0
            keep, accepted, tokens = verify_drafts(s, slots, tokens, keep)
            before = s.num_tokens[slots].astype(np.int64)  # (a plain step needs no copy)
        ends = append_tokens(s, slots, tokens, keep, self.config.max_model_len)
        if drafted:
            # A row that ended (EOS, a stop id) at an accepted draft keeps none after it:
            # drafts accepted past its end saved no step, and are not counted as if they had.
            kept = np.clip(s.num_tokens[slots] - before - 1, 0, accepted)
            self.stats.num_accepted_tokens += int(kept.sum())
            s.drafted_steps[slots] += 1  # (slots: one row each)
            s.accepted_drafts[slots] += kept
        if self.config.drafts_ahead:
            install_ahead(s, slots, accepted)
        finished += self._finish_ended(slots, ends)
        return StepUpdate(finished, applied)

    def _finish_ended(self, slots: np.ndarray, ends: RowEnds) -> list[Request]:
        if not len(ends.rows):
            return []
        ended = slots[ends.rows]
        finished = [self.slots.requests[slot] for slot in ended.tolist()]
        self._drop_running(ended)
        for req, stopped, token in zip(
            finished, ends.stopped.tolist(), ends.stop_token.tolist(), strict=True
        ):
            if token >= 0:
                req.stop_reason = token
            status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_LENGTH
            self._retire(req, status)
        return finished

    def _append_detached(self, req: Request, token: int) -> bool:
        """Append to a request without a slot (preempted, waiting); True when it finished.
        The stop rules are the slots' own (``stop_rules``), on a row of one."""
        req.append_output_token(token)
        params = req.sampling_params

        def ids(values) -> np.ndarray:
            return np.array([list(values) or [-1]], dtype=np.int64)

        rules = stop_rules(
            np.array([[token]]),
            np.array([[req.num_tokens]]),
            np.array([req.num_prompt_tokens]),
            np.array([params.min_tokens]),
            np.array([params.max_tokens]),
            np.array([params.ignore_eos]),
            ids(req.eos_token_ids),
            ids(params.stop_token_ids),
            self.config.max_model_len,
        )
        status = None
        if rules.eos[0, 0] or rules.stop[0, 0]:
            status = RequestStatus.FINISHED_STOPPED
            if rules.stop[0, 0]:
                req.stop_reason = token
        elif rules.length[0, 0]:
            status = RequestStatus.FINISHED_LENGTH
        if status is None:
            return False
        self.waiting.remove(req)
        self._retire(req, status)
        return True

    def _drop_running(self, slots: np.ndarray | list[int]) -> np.ndarray:
        """Take ``slots`` out of the running order, which keeps its order; return those of
        them that were running, in that order. A mask over the slots, not ``np.isin`` (which
        sorts both: 49 against 7 us at 256 rows, CPU)."""
        if not len(slots):
            return self._order[:0]
        dropped = np.zeros(self.slots.capacity, dtype=np.bool_)
        dropped[slots] = True
        running = dropped[self._order]
        ended = self._order[running]
        self._order = self._order[~running]
        return ended

    def _retire(self, req: Request, status: RequestStatus) -> None:
        """Finish ``req``: its status, its KV blocks freed, its slot (if any) given back."""
        req.status = status
        self._release(req)

    def _release(self, req: Request) -> None:
        """Give back ``req``'s slot, if it holds one, and its KV blocks; its full blocks are
        offered to the prefix cache first (output blocks are cached only now: ``_advance``)."""
        if req.slot >= 0:
            s, slot = self.slots, req.slot
            self._cache_blocks_of(req, int(s.num_computed[slot]), int(s.num_cached_full[slot]))
            s.remove(slot)
        self.kv.free(req)
