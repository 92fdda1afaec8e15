"""What a launch sampled, per row, kept on the device for the next launch's inputs.

With async scheduling the next step is launched before the host sees this one's tokens. A
row's next input is its last kept token; after drafts, which one that is (and so where the
row's next step starts) depends on how many drafts the samples accepted, which only the
device knows by then. So right after sampling, the device works it out per row:

    samples  s0 s1 s2 s3   drafts d1 d2 d3      accepted a = leading s_j == d_{j+1} (here 1)
    kept token s_a  ─►  the next step's input at the row's position n + a, not n + k

and the next launch moves that row back (``shift_inputs``): the host started it where all
k drafts land (n + k), so positions, KV slots and the sequence length move by a - k, and its
drafts drafted ahead come from the window at offset a (core/drafts.py):

    next step's row:  input s_a   at n + a          drafts W[a], W[a + 1], .. after it
                      KV slot   = block_tables[row, pos // block_size] * block_size + pos % bs

Every index is built on the host with numpy (``shift_arrays``, ``accept_arrays``) and goes
to the device in the step's one upload with its inputs; the device runs a few gathers and
scatters. ``index_of`` maps a step's token index (varlen order) to where its inputs sit
(CUDA graphs left-pad each row, cuda_graphs.py); None: the same place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.core.runs import within_runs
from tokenmill.engine.host_batch import HostBatch

__all__ = ["SampledRows", "accept_arrays", "sampled_rows", "shift_arrays", "shift_inputs"]


@dataclass(frozen=True)
class SampledRows:
    tokens: torch.Tensor  # [S] int64: each sampling row's last kept token
    row_of_slot: np.ndarray  # [C] batch slot -> its row in ``tokens``; -1: did not sample
    accepted: torch.Tensor | None = None  # [S] drafts each row accepted (None: no drafts)
    shift: torch.Tensor | None = None  # [S] accepted - drafts (<= 0)


def accept_arrays(batch: HostBatch, index_of: np.ndarray | None) -> list[np.ndarray]:
    """The host arrays ``sampled_rows`` needs (uploaded with the step's inputs): none when
    every row samples one token."""
    counts = batch.sample_counts
    if not len(counts) or int(counts.max()) == 1:
        return []
    last = np.cumsum(counts) - 1
    if batch.tree_mask is not None:  # trees run synchronously: no step starts behind them
        return [last]
    k = int(counts.max()) - 1
    first = last - counts + 1
    drafts = counts - 1
    valid = np.arange(k) < drafts[:, None]  # [S, K]
    at = first[:, None] + np.minimum(np.arange(k + 1), drafts[:, None])  # [S, K + 1]
    # the draft checked against sample j is the input after it: the row's next logits row
    following = batch.logits_rows[np.where(valid, first[:, None] + 1 + np.arange(k), 0)]
    return [at, _mapped(following, index_of), valid, drafts]


def sampled_rows(
    sampled: torch.Tensor,
    batch: HostBatch,
    input_ids: torch.Tensor,
    row_of_slot: np.ndarray,
    views: Sequence[torch.Tensor],
) -> SampledRows:
    """The step's rows' kept tokens (and, after drafts, what they accepted) from its flat
    samples [N] and its input ids as the forward pass read them; ``row_of_slot`` [C] maps
    each sampling row's slot to its index in ``batch.sample_slots``; ``views``: the device
    copies of ``accept_arrays``."""
    if not views:
        return SampledRows(sampled, row_of_slot)
    if batch.tree_mask is not None:
        return SampledRows(sampled[views[0]], row_of_slot)
    at_d, following_d, valid_d, drafts_d = views
    k = valid_d.shape[1]
    samples = sampled[at_d]  # [S, K + 1]
    match = (samples[:, :k] == input_ids[following_d]) & valid_d
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    tokens = samples.gather(1, accepted[:, None]).squeeze(1)
    return SampledRows(tokens, row_of_slot, accepted, accepted - drafts_d)


def shift_arrays(
    batch: HostBatch,
    index_of: np.ndarray | None,
    last: SampledRows | None,
) -> list[np.ndarray]:
    """The host arrays ``shift_inputs`` needs (uploaded with the step's inputs): none when
    there is nothing to move or draft ahead."""
    moved = last is not None and last.shift is not None
    if not len(batch.pending_rows) or not (moved or batch.ahead_window is not None):
        return []
    src, reqs = batch.pending_src, batch.pending_reqs
    arrays: list[np.ndarray] = []
    if moved:
        q = batch.query_lens[reqs].astype(np.int64)
        tok = np.repeat(batch.pending_rows, q) + within_runs(q)  # every token of the pending rows
        arrays += [_mapped(tok, index_of), np.repeat(src, q), np.repeat(reqs, q), reqs, src]
    if batch.ahead_window is not None:
        k = batch.pending_drafts.astype(np.int64)
        row = np.repeat(np.arange(len(k)), k)
        j = within_runs(k)
        width = batch.ahead_window.shape[1]
        tok = batch.pending_rows[row] + 1 + j
        arrays += [_mapped(tok, index_of), src[row], row * width + j, batch.ahead_window]
    return arrays


def shift_inputs(
    batch: HostBatch,
    last: SampledRows | None,
    views: Sequence[torch.Tensor],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
) -> None:
    """Move the pending rows of ``batch`` to where the last launch's acceptance put them
    and fill in their drafts drafted ahead (see the top), in place; ``views``: the device
    copies of ``shift_arrays`` (none: nothing to do). The pending tokens are already in
    place."""
    if not views:
        return
    dev = list(views)
    if last is not None and last.shift is not None:
        tok_d, tok_src, tok_row, reqs_d, src_d = dev[:5]
        dev = dev[5:]
        positions.index_add_(0, tok_d, last.shift[tok_src])
        pos = positions[tok_d]
        blocks = block_tables[tok_row, pos // block_size].long()
        slot_mapping[tok_d] = blocks * block_size + pos % block_size
        seq_lens.index_add_(0, reqs_d, last.shift[src_d].to(seq_lens.dtype))
    if batch.ahead_window is not None:
        tok_d, draft_src, at, window = dev
        if last is not None and last.accepted is not None:
            at = at + last.accepted[draft_src]
        input_ids[tok_d] = window.reshape(-1)[at]


def _mapped(tokens: np.ndarray, index_of: np.ndarray | None) -> np.ndarray:
    return tokens if index_of is None else index_of[tokens]
