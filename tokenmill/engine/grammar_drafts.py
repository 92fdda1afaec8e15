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

Masks left open. A row's masks after its drafts cost most of a drafted step's grammar
work (k = 3 on a JSON schema, llguidance: 2-3x the first mask's, BENCHMARKS session 57;
on an H100 a drafted step's masks took 7.9 ms at 64 rows, its forward pass 1.5). For a
greedy row most of them can go: where the draft is one the grammar takes, the position's
argmax over every token is the argmax over the allowed ones whenever it is allowed itself.
So with ``open_rows`` a row's positions after its taken drafts get ``open_mask`` (every
token but the stop tokens) instead of a fill, except where the grammar could end (EOS
allowed: a fill, or EOS would be lost) and the last position before a draft the grammar
refuses (a fill, which forbids that draft):

    drafts d1 d2 d3 (d3 refused):   mask 0 filled | 1 open | 2 filled (forbids d3) | 3 = 2

A sample at an open position either matches the next draft (taken: it was allowed) or is
the row's last kept token, which the grammar then checks without taking it
(``consume_runs(try_last=...)``): allowed, it is what the mask would have given; refused,
the row status is DROPPED and the engine drops the token (the next step samples that
position again under a filled mask). The output stays token-by-token decoding's; a
draft the mask would have let through but the open argmax does not match is lost (where
the model's favourite is refused: on a JSON schema about one position in nine).
``fill_with_drafts`` returns each row's open positions as bits (bit j: position j).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenmill.engine.structured_output_params import DROPPED, TAKEN

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
    open_rows: np.ndarray | None = None,
) -> np.ndarray:
    """Row i's masks go to ``mask[places[i] : places[i] + 1 + counts[i]]``: the mask after
    its output so far, then after each of its ``counts[i]`` drafts (``drafts``: every row's
    drafts one after another). Without drafts, one mask a row at ``places[i]``. Rows where
    ``open_rows`` [rows] bool is set may have positions left open (see the top; only with
    a backend whose ``leaves_masks_open``). Returns [rows] int64, each row's open
    positions as bits."""
    places = np.asarray(places, dtype=np.int64)
    opened = np.zeros(len(rows), dtype=np.int64)
    backend.fill(rows, mask, at=places.tolist())
    if counts is None or not len(counts) or not np.any(counts):
        return opened
    counts = np.asarray(counts, dtype=np.int64)
    drafts = np.asarray(drafts, dtype=np.int64)
    may_open = np.zeros(len(rows), dtype=bool) if open_rows is None else np.asarray(open_rows)
    open_row = backend.open_mask() if may_open.any() else None
    starts = np.cumsum(counts) - counts
    taken = np.zeros(len(rows), dtype=np.int64)  # drafts each row's matcher holds now
    walking = counts > 0
    for j in range(1, int(counts.max()) + 1):
        live = np.flatnonzero(walking & (counts >= j))
        if not len(live):
            break
        ok = backend.advance([rows[i] for i in live], drafts[starts[live] + j - 1].tolist())
        went, refused = live[ok], live[~ok]
        walking[refused] = False
        # a refused draft's position before it (left open at step j - 1) is filled after
        # all, so that its sample cannot be that draft: the matcher is still there
        shut = refused[(opened[refused] >> (j - 1)) & 1 == 1]
        if len(shut):
            opened[shut] &= ~(1 << (j - 1))
            backend.fill([rows[i] for i in shut], mask, at=(places[shut] + j - 1).tolist())
        taken[went] += 1
        fill = went
        if open_row is not None and len(went):
            can = went[may_open[went]]
            if len(can):
                left = can[~backend.accepting([rows[i] for i in can])]
                mask[places[left] + j] = open_row
                opened[left] |= 1 << j
                fill = went[~np.isin(went, left)]
        if len(fill):
            backend.fill([rows[i] for i in fill], mask, at=(places[fill] + j).tolist())
    for i in np.flatnonzero(taken < counts).tolist():  # the walk ended early: repeat its mask
        last = places[i] + taken[i]
        mask[last + 1 : places[i] + counts[i] + 1] = mask[last]
    back = np.flatnonzero(taken)
    if len(back):
        backend.rollback([rows[i] for i in back], taken[back].tolist())
    return opened


def consume_runs(
    backend: Any,
    rows: Sequence[Any],
    tokens: Sequence[int] | np.ndarray,
    counts: np.ndarray | None = None,
    try_last: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Row i's matcher takes its ``counts[i]`` tokens (``tokens``: every row's one after
    another; one each without ``counts``) in turn. Returns [rows] uint8, the status of the
    last token each took (TAKEN, or STOPPED / REJECTED, after which it takes no more), and
    [rows] int64 how many each took (None when each had one). Where ``try_last`` [rows]
    bool is set, the row's last token was sampled at a position left open: it is taken only
    if allowed, else the row's status is DROPPED (its earlier tokens taken)."""
    trying = try_last is not None and bool(np.any(try_last))
    if not trying and (counts is None or not len(rows) or int(np.max(counts)) == 1):
        return backend.consume(rows, list(tokens)), None
    counts = np.ones(len(rows), np.int64) if counts is None else np.asarray(counts, np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    status = np.full(len(rows), TAKEN, dtype=np.uint8)
    took = np.zeros(len(rows), dtype=np.int64)
    for j in range(int(counts.max())):
        live = (counts > j) & (status == TAKEN)
        if trying:
            check = np.flatnonzero(live & try_last & (counts == j + 1))
            if len(check):
                ok = backend.allows([rows[i] for i in check], tokens[starts[check] + j].tolist())
                status[check[~ok]] = DROPPED
                live[check[~ok]] = False
        live = np.flatnonzero(live)
        if not len(live):
            break
        status[live] = backend.consume([rows[i] for i in live], tokens[starts[live] + j].tolist())
        took[live] += 1
    return status, took
