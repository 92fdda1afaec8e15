"""A grammar's work for a row that takes several tokens a step (draft tokens).

A drafted row's step computes logits at 1 + k positions (core/drafts.py): after its output
so far, and after each of its k drafts in turn. Each position needs the mask of the grammar
in the state its tokens lead to, so the masks are filled walking the drafts:

    row with drafts d1 d2 d3:   mask 0 (as now) ─► take d1 ─► mask 1 ─► take d2 ─► mask 2 ..
                                then give back what was taken (``rollback``)

A draft the grammar does not allow (or a stop token) ends the walk: the masks after it
repeat the last one filled. They are never used for a kept token: the sample at the
draft's position cannot be the draft (the mask there forbids it), so verification keeps no
sample after it; they only give those positions a sane distribution to sample from.

The step's kept tokens (its accepted drafts and the token after them: 1..1 + k) are then
consumed in turn (``consume_runs``), a row stopping at the first token that completes or
breaks its grammar. Both work on any in-process backend (grammar_llguidance.py,
grammar_xgrammar.py: ``fill``, ``consume``, ``advance``, ``rollback``), in the engine's
process or in a grammar worker (grammar_processes.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenmill.engine.structured_output_params import TAKEN

__all__ = ["consume_runs", "fill_with_drafts", "mask_rows"]


def mask_rows(counts: np.ndarray | None, rows: int) -> int:
    """Mask rows a step's ``rows`` constrained rows take: one each and one per draft."""
    return rows if counts is None else rows + int(np.sum(counts))


def fill_with_drafts(
    backend: Any,
    rows: Sequence[Any],
    mask: np.ndarray,
    places: Sequence[int] | np.ndarray,
    drafts: np.ndarray | None = None,
    counts: np.ndarray | None = None,
) -> None:
    """Row i's masks go to ``mask[places[i] : places[i] + 1 + counts[i]]``: the mask after
    its output so far, then after each of its ``counts[i]`` drafts (``drafts``: every row's
    drafts one after another). Without drafts, one mask a row at ``places[i]``."""
    places = np.asarray(places, dtype=np.int64)
    backend.fill(rows, mask, at=places.tolist())
    if counts is None or not len(counts) or not np.any(counts):
        return
    counts = np.asarray(counts, dtype=np.int64)
    drafts = np.asarray(drafts, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    taken = np.zeros(len(rows), dtype=np.int64)  # drafts each row's matcher holds now
    walking = counts > 0
    for j in range(1, int(counts.max()) + 1):
        live = np.flatnonzero(walking & (counts >= j))
        if not len(live):
            break
        ok = backend.advance([rows[i] for i in live], drafts[starts[live] + j - 1].tolist())
        went = live[ok]
        walking[live[~ok]] = False
        taken[went] += 1
        if len(went):
            backend.fill([rows[i] for i in went], mask, at=(places[went] + j).tolist())
    for i in np.flatnonzero(taken < counts).tolist():  # the walk ended early: repeat its mask
        last = places[i] + taken[i]
        mask[last + 1 : places[i] + counts[i] + 1] = mask[last]
    back = np.flatnonzero(taken)
    if len(back):
        backend.rollback([rows[i] for i in back], taken[back].tolist())


def consume_runs(
    backend: Any,
    rows: Sequence[Any],
    tokens: Sequence[int] | np.ndarray,
    counts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Row i's matcher takes its ``counts[i]`` tokens (``tokens``: every row's one after
    another; one each without ``counts``) in turn. Returns [rows] uint8, the status of the
    last token each took (TAKEN, or STOPPED / REJECTED, after which it takes no more), and
    [rows] int64 how many each took (None when each had one)."""
    if counts is None or not len(rows) or int(np.max(counts)) == 1:
        return backend.consume(rows, list(tokens)), None
    counts = np.asarray(counts, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    status = np.full(len(rows), TAKEN, dtype=np.uint8)
    took = np.zeros(len(rows), dtype=np.int64)
    for j in range(int(counts.max())):
        live = np.flatnonzero((counts > j) & (status == TAKEN))
        if not len(live):
            break
        status[live] = backend.consume([rows[i] for i in live], tokens[starts[live] + j].tolist())
        took[live] += 1
    return status, took
