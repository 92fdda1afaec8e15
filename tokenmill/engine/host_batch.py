"""HostBatch: one step's inputs flattened on the host (numpy), before they go to the device.

    input_ids, positions, slot_mapping:  [T]        (T = tokens scheduled this step)
    query_lens, seq_lens:                [B]
    block_tables:                        [B, max_blocks]   padded with 0
    logits_rows:                         [S]        last token of each request that samples
    rows are the scheduled requests with the one-token ones (decodes) moved first
    pending_rows, pending_src:           [P]        async scheduling: input_ids[pending_rows[i]]
                                                    is the previous step's sampled token
                                                    number pending_src[i] (0 until filled in)

slot of position p in row b = block_tables[b, p // block_size] * block_size + p % block_size
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class HostBatch:
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    logits_rows: np.ndarray
    sampling: tuple[ScheduledRequest, ...]
    pending_rows: np.ndarray
    pending_src: np.ndarray
    pending_sampling_rows: tuple[int, ...]  # index in ``sampling`` of each pending row

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def decode_only(self) -> bool:
        return self.num_tokens == self.num_reqs

    @property
    def sampled_positions(self) -> dict[str, int]:
        """Request id -> its row in this step's sampled tokens (what the next step's
        ``prev_rows`` is)."""
        return {s.request_id: i for i, s in enumerate(self.sampling)}

    @classmethod
    def build(
        cls, sched: SchedulerOutput, block_size: int, prev_rows: dict[str, int] | None = None
    ) -> HostBatch:
        """Flatten ``sched``. ``prev_rows`` (the previous step's ``sampled_positions``) is
        where each pending input token will come from; raises RuntimeError when a request has
        a pending token the previous step did not sample."""
        # One-token rows first (stable): attention backends run them with the decode kernel.
        rows = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)
        n = len(rows)
        query_lens = np.fromiter((s.num_new_tokens for s in rows), dtype=np.int32, count=n)
        seq_lens = np.fromiter((s.end for s in rows), dtype=np.int32, count=n)
        total = int(query_lens.sum())
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        width = max((len(s.block_ids) for s in rows), default=1)
        block_tables = np.zeros((n, max(width, 1)), dtype=np.int32)
        logits_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        pending_rows: list[int] = []
        pending_src: list[int] = []
        pending_sampling: list[int] = []
        offset = 0
        for i, s in enumerate(rows):
            end = offset + s.num_new_tokens
            known = s.request.num_tokens
            if s.end > known:  # the last input is the token the previous step sampled
                src = (prev_rows or {}).get(s.request_id)
                if src is None or s.end != known + 1:
                    raise RuntimeError(
                        f"request {s.request_id}: its pending input token was not sampled by "
                        "the previous step"
                    )
                pending_rows.append(end - 1)
                pending_src.append(src)
                pending_sampling.append(len(sampling))  # such a row always samples
                input_ids[end - 1] = 0
            if s.num_new_tokens == 1:
                if s.start < known:
                    input_ids[offset] = s.request.all_token_ids[s.start]
                positions[offset] = s.start
            else:
                stop = min(s.end, known)
                input_ids[offset : offset + stop - s.start] = s.request.all_token_ids[
                    s.start : stop
                ]
                positions[offset:end] = np.arange(s.start, s.end)
            block_tables[i, : len(s.block_ids)] = s.block_ids
            if s.sample:
                logits_rows.append(end - 1)
                sampling.append(s)
            offset = end
        row_of_token = np.repeat(np.arange(n), query_lens)
        slots = (
            block_tables[row_of_token, positions // block_size].astype(np.int64) * block_size
            + positions % block_size
        )
        return cls(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slots,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=block_tables,
            logits_rows=np.asarray(logits_rows, dtype=np.int64),
            sampling=tuple(sampling),
            pending_rows=np.asarray(pending_rows, dtype=np.int64),
            pending_src=np.asarray(pending_src, dtype=np.int64),
            pending_sampling_rows=tuple(pending_sampling),
        )
