"""Draft tokens for multi-token (speculative) steps: the proposer interface and acceptance.

A decode row normally computes one token: its last known one, whose logits pick the next.
With k draft tokens it computes 1 + k in the same step, and the logits at each of them are
checked against the draft that follows:

    known:   [ ... t ]                 drafts d1 d2 d3          (k = 3)
    inputs:        t  d1 d2 d3         positions n-1 .. n+2
    sampled:       s0 s1 s2 s3         s_j is drawn from the target given t, d1..dj
    accepted: the longest prefix with s_j == d_{j+1}; the row appends s0..s_a (a + 1 tokens)

Sampling s_j from the target and keeping it when it equals the draft is exact for drafts that
are a single token each (n-gram, suffix, tests): the row's tokens have the target's
distribution, greedy or not. Rejected positions' KV is simply recomputed later (the row's
computed count rolls back to its new known tokens minus one).

Numpy, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from tokenmill.engine.core.batch_slots import BatchSlots

__all__ = ["DraftProposer", "accepted_counts", "draft_lengths"]


class DraftProposer(Protocol):
    """Proposes up to ``max_drafts`` tokens per row from what the slots hold.

    ``propose`` gets the batch slots and the slots ([R]) of rows that may take drafts (decode
    rows whose tokens are all known on the host) and returns [R, max_drafts] int64 token ids;
    -1 ends a row's drafts (a row's drafts are the entries before its first -1). It must not
    change the slots, and its cost is on every step's host path: vectorize it.
    """

    max_drafts: int

    def propose(self, slots: BatchSlots, rows: np.ndarray) -> np.ndarray: ...


def draft_lengths(drafts: np.ndarray) -> np.ndarray:
    """[R] the number of entries before each row's first -1."""
    if drafts.shape[1] == 0:
        return np.zeros(len(drafts), dtype=np.int64)
    return np.cumprod(drafts >= 0, axis=1).sum(axis=1)


def accepted_counts(sampled: np.ndarray, drafts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[R] how many drafts each row accepts: the leading j < lengths[r] with
    ``sampled[r, j] == drafts[r, j]`` (``sampled`` [R, K + 1], ``drafts`` [R, K])."""
    k = drafts.shape[1]
    match = (sampled[:, :k] == drafts) & (np.arange(k) < lengths[:, None])
    return np.cumprod(match, axis=1).sum(axis=1)
