"""Which tokens a constrained row's grammar sees in a drafted step (the engine's side of
grammar_drafts.py): numpy over the batch slots, no grammar calls.

- ``kept_tokens``: after a step, each constrained row keeps its sampled tokens up to the
  first that differs from its draft (the accepted drafts and the one after them), as the
  scheduler will (core/drafts.py ``verify_drafts``, a chain); they are what its grammar
  takes, before the scheduler applies them.
- ``step_drafts``: the drafts the step being launched gives its constrained rows, which
  their masks walk: written after the row's known tokens, or, drafted ahead of the step in
  flight, its ahead window read from where that step's accepted drafts put it (known once
  that step's tokens were fed: ``kept_tokens``).
"""

from __future__ import annotations

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.drafts import accepted_counts
from tokenmill.engine.core.runs import within_runs

__all__ = ["kept_tokens", "step_drafts"]


def kept_tokens(
    table: BatchSlots, slots: np.ndarray, sampled: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For rows in ``slots`` [R] that sampled ``counts[r]`` tokens each (``sampled``: every
    row's one after another, drafts still in the table after the row's known tokens):
    (tokens each keeps [R], the kept tokens one row after another, drafts each accepted)."""
    first = np.cumsum(counts) - counts
    k = counts.astype(np.int64) - 1
    accepted = np.zeros(len(slots), dtype=np.int64)
    drafted = np.flatnonzero(k)
    if len(drafted):
        rows, width = slots[drafted], int(k.max())
        at = np.minimum(first[drafted][:, None] + np.arange(width + 1), len(sampled) - 1)
        n = table.num_tokens[rows].astype(np.int64)
        places = np.minimum(n[:, None] + np.arange(width), table.token_ids.shape[1] - 1)
        drafts = table.token_ids[rows[:, None], places]
        accepted[drafted] = accepted_counts(sampled[at], drafts, k[drafted])
    kept = accepted + 1
    return kept, sampled[np.repeat(first, kept) + within_runs(kept)], accepted


def step_drafts(
    table: BatchSlots, slots: np.ndarray, counts: np.ndarray, accepted_ahead: dict[int, int]
) -> tuple[np.ndarray, np.ndarray] | None:
    """(counts, their tokens one row after another) of the drafts of the rows in ``slots``
    (``counts[i]`` each) in the step being launched; ``accepted_ahead``: slot -> drafts its
    row accepted in the step in flight, for rows drafted ahead of it. None without drafts."""
    if not counts.any():
        return None
    drafted = np.flatnonzero(counts)
    rows, k = slots[drafted], counts[drafted].astype(np.int64)
    ahead = table.num_ahead[rows] > 0
    start = table.num_tokens[rows].astype(np.int64)
    if ahead.any():
        start[ahead] = [accepted_ahead.get(slot, 0) for slot in rows[ahead].tolist()]
    where, at = np.repeat(rows, k), np.repeat(start, k) + within_runs(k)
    from_ahead = np.repeat(ahead, k)
    tokens = table.token_ids[where, np.where(from_ahead, 0, at)].astype(np.int64)
    if ahead.any():
        tokens[from_ahead] = table.ahead_window[where[from_ahead], at[from_ahead]]
    return counts, tokens
