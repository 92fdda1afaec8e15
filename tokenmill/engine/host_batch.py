"""HostBatch: one step's inputs flattened on the host (numpy), before they go to the device.

    input_ids, positions, slot_mapping:  [T]        (T = tokens scheduled this step)
    query_lens, seq_lens:                [B]
    block_tables:                        [B, max_blocks]   padded with 0
    logits_rows:                         [N]        tokens whose logits are sampled: the last
                                                    of each row that samples, and its drafts'
                                                    positions before it (1 + k per row)
    sample_rows, sample_slots,           [S]        per row that samples: its index in the
    sample_counts                                   SchedulerOutput, its batch slot, and how
                                                    many logits rows it has (1 + drafts)
    pending_rows, pending_src:           [P]        async scheduling: input_ids[pending_rows[i]]
                                                    is the previous step's sampled token
                                                    of its row pending_src[i] (0 until
                                                    filled in)
    pending_reqs, pending_drafts:        [P]        the row of each pending token, and its
                                                    drafts this step
    ahead_window:                        [P, W]     drafted ahead (core/drafts.py): the
                                                    predictions a pending row's drafts are
                                                    taken from, on the device (None: none)
    pending_sampling_rows:               [P]        index in the N logits rows of each
    logits_depth:                        [N]        how far past the row's last known token
                                                    each logits row is (0, then its drafts')
    tree_mask:                           [T] | None rows with a tree of drafts: which of the
                                                    row's step tokens each sees (int64 bits,
                                                    -1 for every other token; None: no tree)

Rows are the scheduled rows with the decode rows moved first (``num_decodes`` of them: a
request's last token, plus its drafts if it has some). Built with numpy over all rows at
once: token ids come from the batch slots' token table.

    row b, its q tokens at positions starts[b] .. starts[b] + q - 1:
        input_ids  = token_ids[slot_b, position]        (known on the host, or a draft)
                     or 0, filled on the device          (the pending last token)

    a row with k drafts:  inputs  t d1 .. dk  ─►  logits rows at all 1 + k of them
    a pending row's tokens (t pending, its drafts drafted ahead) start where all drafts in
    flight land: the device moves them back by the ones rejected (model_runner.py)
        slot of position p = block_tables[b, p // block_size] * block_size + p % block_size

    a row with a tree of drafts (core/draft_tree.py): its tokens take token-table places and
    KV slots one after another as above, but a draft's RoPE position is t's plus its depth,
    and ``tree_mask`` limits what it sees to its ancestors
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.engine.core.draft_tree import tree_layout
from tokenmill.engine.core.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class HostBatch:
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    logits_rows: np.ndarray
    sample_rows: np.ndarray
    sample_slots: np.ndarray
    sample_counts: np.ndarray
    pending_rows: np.ndarray
    pending_src: np.ndarray
    pending_sampling_rows: np.ndarray
    num_decodes: int
    logits_depth: np.ndarray
    pending_reqs: np.ndarray
    pending_drafts: np.ndarray
    ahead_window: np.ndarray | None = None
    tree_mask: np.ndarray | None = None
    num_trees: int = 0  # rows with a tree of drafts (not decode rows)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def decode_only(self) -> bool:
        """Every row is a decode row (one token, or one and its drafts)."""
        return self.num_decodes == self.num_reqs

    @property
    def decode_step(self) -> bool:
        """Every row decodes: one token, or with drafts (a chain, or a tree)."""
        return self.num_decodes + self.num_trees == self.num_reqs

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens.max(initial=0))

    @classmethod
    def build(
        cls, sched: SchedulerOutput, block_size: int, prev_row_of_slot: np.ndarray | None = None
    ) -> HostBatch:
        """Flatten ``sched``. ``prev_row_of_slot`` ([C], -1 where none) is each slot's row in
        the previous step's sampled tokens, where a pending input token comes from; raises
        RuntimeError when a row has a pending token the previous step did not sample."""
        table = sched.table
        decode = sched.decode
        order = np.argsort(~decode, kind="stable")  # decode rows first
        slots = sched.slots[order]
        starts = sched.starts[order]
        query_lens = sched.num_new[order]
        n = len(order)
        seq_lens = starts + query_lens
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        total = int(qsl[-1])
        if total == n:  # decode-only: one token per row
            row_of_token = np.arange(n)
            positions = starts.copy()
        else:
            row_of_token = np.repeat(np.arange(n), query_lens)
            positions = starts[row_of_token] + np.arange(total) - qsl[row_of_token]
        # drafts sit in the token table after the known tokens (this step's, or in flight)
        known = table.num_tokens[slots].astype(np.int64) + table.num_drafts[slots]
        drafts = sched.drafts[order]  # this step's
        pend = np.flatnonzero(seq_lens > known)  # the input is a pending token (+ drafts)
        input_ids = np.zeros(total, dtype=np.int64)
        if len(pend):
            is_known = positions < known[row_of_token]
            input_ids[is_known] = table.token_ids[
                slots[row_of_token[is_known]], positions[is_known]
            ]
        else:
            input_ids[:] = table.token_ids[slots[row_of_token], positions]
        width = max(int(table.num_blocks[slots].max(initial=1)), 1)
        block_tables = table.block_table[slots, :width]
        block_tables[np.arange(width) >= table.num_blocks[slots][:, None]] = 0
        slot_mapping = (
            block_tables[row_of_token, positions // block_size].astype(np.int64) * block_size
            + positions % block_size
        )
        sample = sched.sample[order]
        num_logits = np.where(sample, 1 + drafts, 0)  # [B]
        first_logit = np.cumsum(num_logits) - num_logits  # [B] its first logits row
        total_logits = int(num_logits.sum())
        logits_depth = np.arange(total_logits) - np.repeat(first_logit, num_logits)
        logits_rows = np.repeat(qsl[1:] - num_logits, num_logits) + logits_depth
        tree_mask = None
        trees = np.flatnonzero(table.draft_tree[slots] & (drafts > 0))
        if len(trees):  # their step tokens are exactly t and its drafts, all sampled
            k = int(drafts[trees].max())
            depth, masks = tree_layout(
                table.draft_parent[slots[trees], :k].astype(np.int64), drafts[trees]
            )
            live = np.arange(k + 1) <= drafts[trees][:, None]  # [R, k + 1]
            tokens = (qsl[trees][:, None] + np.arange(k + 1))[live]
            positions = positions.copy()
            positions[tokens] = (starts[trees][:, None] + depth)[live]
            tree_mask = np.full(total, -1, dtype=np.int64)
            tree_mask[tokens] = masks[live]
            rows = (first_logit[trees][:, None] + np.arange(k + 1))[live]
            logits_depth[rows] = depth[live]
        pending_src = np.empty(0, dtype=np.int64)
        if len(pend):
            src = (
                np.full(len(pend), -1)
                if prev_row_of_slot is None
                else prev_row_of_slot[slots[pend]]
            )
            bad = (src < 0) | (seq_lens[pend] != known[pend] + 1 + drafts[pend])
            if bad.any():
                req = sched.requests[order[pend[np.argmax(bad)]]]
                raise RuntimeError(
                    f"request {req.request_id}: its pending input token was not sampled by "
                    "the previous step"
                )
            pending_src = src.astype(np.int64)
        ahead_window = None
        if drafts[pend].any():
            ahead_window = table.ahead_window[slots[pend]]
        return cls(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_lens=query_lens.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            block_tables=block_tables,
            logits_rows=logits_rows,
            sample_rows=order[sample],
            sample_slots=slots[sample],
            sample_counts=num_logits[sample],
            pending_rows=qsl[pend + 1] - 1 - drafts[pend],
            pending_src=pending_src,
            pending_sampling_rows=first_logit[pend],
            num_decodes=int(decode.sum()),
            logits_depth=logits_depth,
            pending_reqs=pend,
            pending_drafts=drafts[pend],
            ahead_window=ahead_window,
            tree_mask=tree_mask,
            num_trees=len(trees),
        )
