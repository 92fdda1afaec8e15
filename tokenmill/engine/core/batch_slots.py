"""BatchSlots: the running requests' per-step state in preallocated arrays, one row per slot.

A request takes a slot when it is admitted and gives it back when it finishes or is
preempted. While it holds one, the arrays are where its state lives (``Request`` reads and
writes through to them), so a step works on all rows at once with numpy:

    slot ─► token_ids[slot, :num_tokens]      prompt + output tokens known on the host
            token_ids[slot, num_tokens : num_tokens + num_drafts]   this step's draft tokens
            num_tokens, num_prompt, num_computed, num_pending, num_drafts  [C] int32
            draft_tree[slot], draft_parent[slot, :num_drafts]   a tree's shape (draft_tree.py)
            ahead_window[slot], num_ahead   drafts of a step scheduled while the row's
                                            previous one is in flight (drafts.py: the device
                                            picks them once it knows what that one accepted)
            max_tokens, min_tokens, ignore_eos, eos_ids[slot], stop_ids[slot]
            drafted_steps, accepted_drafts   drafted steps the row was in since its admission,
                                            and the drafts it accepted in them (its yield)
            block_table[slot, :num_blocks]    its KV block ids (a copy of the KV manager's)
            sampling.columns[...][slot]       temperature, top_k, ... (SamplingColumns)
            requests[slot]                    the Request itself (object array)

    C = capacity (max_num_seqs); token_ids is [C, max_model_len], allocated lazily by the OS
    (np.zeros), so only rows and positions in use take memory.

Rows of free slots hold stale values; only slots listed by the scheduler are read.
Numpy only: no torch.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.engine.core.draft_tree import MAX_TREE_DRAFTS
from tokenmill.engine.core.runs import within_runs
from tokenmill.engine.sampling_columns import SamplingColumns

if TYPE_CHECKING:
    from tokenmill.engine.core.request import Request

__all__ = ["BatchSlots"]


class BatchSlots:
    """``capacity`` slots for requests of up to ``max_model_len`` tokens."""

    def __init__(
        self, capacity: int, max_model_len: int, block_size: int, ahead_width: int = 0
    ) -> None:
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.token_ids = np.zeros((capacity, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(capacity, dtype=np.int32)
        self.num_prompt = np.zeros(capacity, dtype=np.int32)
        self.num_computed = np.zeros(capacity, dtype=np.int32)
        self.num_pending = np.zeros(capacity, dtype=np.int32)
        # Draft tokens scheduled after the known ones (speculative steps); 0 between steps.
        self.num_drafts = np.zeros(capacity, dtype=np.int32)
        # A tree of drafts (not one chain): each draft's parent step token (draft_tree.py).
        self.draft_tree = np.zeros(capacity, dtype=np.bool_)
        self.draft_parent = np.zeros((capacity, MAX_TREE_DRAFTS), dtype=np.int8)
        # Drafted ahead of the row's step in flight: the predicted tokens after its known
        # ones (``ahead_width`` of them) and how many this step drafts (add_drafts).
        self.ahead_window = np.zeros((capacity, ahead_width), dtype=np.int64)
        self.num_ahead = np.zeros(capacity, dtype=np.int32)
        self.max_tokens = np.zeros(capacity, dtype=np.int64)
        self.min_tokens = np.zeros(capacity, dtype=np.int64)
        self.ignore_eos = np.zeros(capacity, dtype=np.bool_)
        self.drafted_steps = np.zeros(capacity, dtype=np.int32)
        self.accepted_drafts = np.zeros(capacity, dtype=np.int64)
        self.eos_ids = np.full((capacity, 1), -1, dtype=np.int64)  # padded with -1
        self.stop_ids = np.full((capacity, 1), -1, dtype=np.int64)
        max_blocks = -(-max_model_len // block_size)
        self.block_table = np.zeros((capacity, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(capacity, dtype=np.int32)
        # Full blocks of known tokens when the KV manager last cached the slot's blocks: a
        # step calls cache_blocks only for the rows that filled another block since.
        self.num_cached_full = np.zeros(capacity, dtype=np.int32)
        self.sampling = SamplingColumns(capacity)
        self.requests = np.full(capacity, None, dtype=object)
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def add(self, request: Request) -> int:
        """Give ``request`` a free slot, copy its state in, and attach it (its fields now read
        and write the slot). Raises RuntimeError when no slot is free."""
        return int(self.add_many([request])[0])

    def add_many(self, requests: list[Request]) -> np.ndarray:
        """``add`` each of ``requests``, in order, in one pass over the arrays (an admission
        of ~46 rows a step: one row at a time took ~9 us a row of admission's ~33, CPU);
        returns their slots [R]. Raises RuntimeError when too few slots are free and
        ValueError for a request longer than max_model_len, before taking any slot."""
        if len(requests) > len(self._free):
            raise RuntimeError(
                f"{len(requests)} requests for {len(self._free)} free of {self.capacity} "
                "batch slots"
            )
        tokens = [r.all_token_ids for r in requests]
        lens = np.fromiter(map(len, tokens), dtype=np.int64, count=len(requests))
        for request, n in zip(requests, lens.tolist(), strict=True):
            if n > self.max_model_len:
                raise ValueError(
                    f"request {request.request_id}: {n} tokens exceed max_model_len "
                    f"{self.max_model_len}"
                )
        slots = np.array([self._free.pop() for _ in requests], dtype=np.int64)
        # every request's tokens in one assignment: row slot[i], columns 0 .. lens[i] - 1
        total = int(lens.sum())
        at = np.repeat(slots, lens)
        cols = within_runs(lens)
        self.token_ids[at, cols] = np.fromiter(chain.from_iterable(tokens), np.int64, total)
        params = [r.sampling_params for r in requests]
        self.num_tokens[slots] = lens
        self.num_prompt[slots] = [r.num_prompt_tokens for r in requests]
        self.num_computed[slots] = [r.num_computed_tokens for r in requests]
        self.num_pending[slots] = [r.num_pending_tokens for r in requests]
        self.num_drafts[slots] = 0
        self.num_ahead[slots] = 0
        self.draft_tree[slots] = False
        self.drafted_steps[slots] = 0
        self.accepted_drafts[slots] = 0
        self.max_tokens[slots] = [p.max_tokens for p in params]
        self.min_tokens[slots] = [p.min_tokens for p in params]
        self.ignore_eos[slots] = [p.ignore_eos for p in params]
        self.eos_ids = _set_padded_rows(self.eos_ids, slots, [r.eos_token_ids for r in requests])
        self.stop_ids = _set_padded_rows(self.stop_ids, slots, [p.stop_token_ids for p in params])
        self.num_blocks[slots] = 0
        self.num_cached_full[slots] = 0
        self.sampling.set_rows(slots.tolist(), params)
        for slot, request in zip(slots.tolist(), requests, strict=True):
            self.requests[slot] = request
            request.attach(self, slot)
        return slots

    def remove(self, slot: int) -> None:
        """Detach the slot's request (its state copied back to it) and free the slot."""
        request = self.requests[slot]
        if request is None:
            raise RuntimeError(f"batch slot {slot} is not taken")
        request.detach()
        self.requests[slot] = None
        self._free.append(slot)

    def set_blocks(self, slot: int, block_ids: list[int], start: int = 0) -> None:
        """Write the slot's block table from index ``start`` on (its new blocks)."""
        end = start + len(block_ids)
        self.block_table[slot, start:end] = block_ids
        self.num_blocks[slot] = end

    def block_ids(self, slot: int) -> tuple[int, ...]:
        return tuple(self.block_table[slot, : self.num_blocks[slot]].tolist())


def _set_padded_rows(
    table: np.ndarray, rows: np.ndarray, values: list[tuple[int, ...]]
) -> np.ndarray:
    """Write ``values[i]`` into ``table[rows[i]]`` padded with -1, widening the table if
    needed; returns the table (a new one when widened)."""
    width = max(map(len, values), default=0)
    if width > table.shape[1]:
        wider = np.full((table.shape[0], width), -1, dtype=table.dtype)
        wider[:, : table.shape[1]] = table
        table = wider
    table[rows] = -1
    if width:
        padded = [tuple(v) + (-1,) * (width - len(v)) for v in values]
        table[rows, :width] = padded
    return table
