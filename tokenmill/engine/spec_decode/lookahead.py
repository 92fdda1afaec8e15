"""LookaheadProposer: Jacobi iteration over a window of guessed future tokens, an n-gram pool
filled from the window's trajectories, and the pool's candidates verified, all in the row's
normal step as one tree of drafts (engine/core/draft_tree.py). No draft model, no training.

Per row, L = ``ngram`` - 1 levels of W guesses (the window); one pool of L-token
continuations keyed by the token before them. A step computes, under the row's last token t:

    candidates   up to G chains of L tokens: what followed the row's latest earlier match
                 of its last tokens (prompt lookup, spec_decode/ngram.py), then the pool's
                 continuations of t, newest first
    window       level 0: a chain of W guesses under t; level l > 0: W guesses, each under
                 the level below it in the same window column

    step index:  1 .. base - 1: the candidates' chains (up to L tokens each);
                 base + l*W + j: window level l, column j; its ancestors:
                 (l-1, j) .. (0, j), (0, j-1) .. (0, 0), t

so window token (l, j) sees the context, t, level 0 up to column j and its own column's
lower levels: a diagonal trajectory. The token sampled there continues that trajectory:

    gram j = window[0, j], window[1, j], .., window[L-1, j], sample(L-1, j)  (N = L + 1)

Each step adds W such grams to the pool (key: the first token; the newest G distinct
continuations of a key kept, spec_decode/gram_pool.py), then the window moves one level down
and its top level becomes the top level's samples (the next Jacobi iterate). The pool is
the engine's, shared by all rows (a job's rows often say the same things), bounded to
``pool_keys`` key places (a key takes its place from another), and the outputs of finished
rows feed it too (``observe``).

Candidates and window are verified alike: the row keeps the path its samples follow
through the tree, so output is exactly the target's. A new row's window starts from random
tokens of its prompt.

Every step's work is numpy over all its rows at once (windows [C, L, W] by slot), no loop
over rows or tokens. It suits small batches all the same: a step carries W*L + G*L extra
tokens a row, which cost about nothing only while a GPU's decode is memory-bound; it drafts
on every step it is chosen for.
"""

from __future__ import annotations

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.draft_tree import MAX_TREE_DRAFTS, DraftTree
from tokenmill.engine.spec_decode.gram_pool import GramPool
from tokenmill.engine.spec_decode.ngram import NgramProposer

__all__ = ["LookaheadProposer"]


class LookaheadProposer:
    makes_trees = True  # the engine captures CUDA graphs for its tree steps

    def __init__(
        self,
        ngram: int = 4,
        window: int = 5,
        candidates: int = 5,
        seed: int = 0,
        pool_keys: int = 1 << 18,
    ) -> None:
        levels = ngram - 1
        if levels < 1 or window < 1 or candidates < 0:
            raise ValueError(
                f"lookahead needs ngram >= 2, window >= 1 and candidates >= 0, got "
                f"{ngram}, {window}, {candidates}"
            )
        if (window + candidates) * levels > MAX_TREE_DRAFTS:
            raise ValueError(
                f"lookahead: (window {window} + candidates {candidates}) x (ngram {ngram} - 1) "
                f"drafts exceed the {MAX_TREE_DRAFTS} a step's tree holds"
            )
        self.levels = levels
        self.width = window
        self.candidates = candidates
        self.max_drafts = (window + candidates) * levels
        self._rng = np.random.default_rng(seed)
        # By slot, allocated at the first step (BatchSlots' capacity): the window [L, W],
        # the request it belongs to, and the step index of its (0, 0) in the last tree.
        self.windows = np.zeros((0, levels, window), dtype=np.int64)
        self.bases = np.zeros(0, dtype=np.int64)
        self._owner = np.empty(0, dtype=object)
        self._lookup = NgramProposer(levels) if candidates else None
        self.pool = GramPool(levels, max(candidates, 1), pool_keys)
        # The tree's fixed parts: a candidate chain's parents (its first hangs under t),
        d = np.arange(candidates * levels)
        self._chain_parents = np.where(d % levels == 0, 0, d)
        # and a window token's parent, as steps back from its own step index (0: under t)
        level, column = np.divmod(np.arange(levels * window), window)
        self._window_at = np.arange(levels * window)
        self._window_back = np.where(level == 0, 1, window)
        self._under_t = (level == 0) & (column == 0)

    def propose(self, slots: BatchSlots, rows: np.ndarray) -> DraftTree:
        """A tree per row in ``rows`` (slots): its candidates for its last token, then its
        window (see the top)."""
        lv, g = self.levels, self.candidates
        rows = np.asarray(rows, dtype=np.int64)
        r = len(rows)
        self._start_rows(slots, rows)
        tokens = np.full((r, self.max_drafts), -1, dtype=np.int64)
        parents = np.zeros((r, self.max_drafts), dtype=np.int64)
        at = np.zeros(r, dtype=np.int64)  # drafts taken by candidates: the window goes next
        if g:
            n = slots.num_tokens[rows].astype(np.int64)
            last = slots.token_ids[rows, n - 1].astype(np.int64)
            pooled, real = self.pool.lookup(last)  # [R, G, L] newest first, [R, G]
            looked_up = self._lookup.propose(slots, rows)  # [R, L]: a match's continuation
            found = looked_up[:, 0] >= 0
            # the match's continuation first where there is one, then the pool's (its real
            # ones come first)
            chains = np.where(
                found[:, None, None],
                np.concatenate([looked_up[:, None, :], pooled[:, : g - 1]], axis=1),
                pooled,
            )
            count = np.minimum(found + real.sum(axis=1), g)
            used = np.repeat(np.arange(g)[None, :] < count[:, None], lv, axis=1)  # [R, G*L]
            tokens[:, : g * lv] = np.where(used, chains.reshape(r, g * lv), -1)
            parents[:, : g * lv] = np.where(used, self._chain_parents, 0)
            at = count * lv
        base = at + 1  # the window's first step index
        idx = at[:, None] + self._window_at  # [R, L*W] draft indices of (l, j), l*W + j
        parent = np.where(self._under_t, 0, idx + 1 - self._window_back)  # step index = idx + 1
        tokens[np.arange(r)[:, None], idx] = self.windows[rows].reshape(r, len(self._window_at))
        parents[np.arange(r)[:, None], idx] = parent
        self.bases[rows] = base
        return DraftTree(tokens, parents)

    def observe_samples(
        self, slots: BatchSlots, rows: np.ndarray, sampled: np.ndarray, counts: np.ndarray
    ) -> None:
        """What each drafted row ([R] slots) sampled at its step tokens ([R, M], ``counts``
        of them): grams from the window's top level into the pool, then the window moves."""
        lv, w = self.levels, self.width
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows) or len(self.bases) < slots.capacity:
            return
        mine = (self.bases[rows] > 0) & (self._owner[rows] == slots.requests[rows])
        top = self.bases[rows] + (lv - 1) * w  # step index of (L-1, 0)
        whole = mine & (np.asarray(counts) >= top + w)  # not cut short (near max_tokens)
        self.bases[rows[mine]] = 0
        if not whole.any():
            return
        at = rows[whole]
        drafted = np.asarray(sampled)[whole]
        new = drafted[np.arange(len(at))[:, None], top[whole, None] + np.arange(w)]  # [R', W]
        window = self.windows[at]  # [R', L, W]
        grams = np.concatenate([window, new[:, None, :]], axis=1)  # [R', L + 1, W]: a column each
        grams = grams.transpose(0, 2, 1).reshape(-1, lv + 1)
        self.pool.add(grams[:, 0], grams[:, 1:])
        self.windows[at] = np.concatenate([window[:, 1:], new[:, None, :]], axis=1)

    def observe(self, outputs: list[list[int]]) -> None:
        """Outputs of requests that just finished: each n-gram of them joins the pool."""
        lv = self.levels
        grams = [
            np.lib.stride_tricks.sliding_window_view(np.asarray(out, dtype=np.int64), lv + 1)
            for out in outputs
            if len(out) > lv
        ]
        if grams:
            every = np.concatenate(grams)
            self.pool.add(every[:, 0], every[:, 1:])

    def close(self) -> None:
        """Nothing runs beside the engine here."""

    def _start_rows(self, slots: BatchSlots, rows: np.ndarray) -> None:
        """Fresh windows (random tokens of the prompt) for rows another request holds now."""
        if len(self.bases) < slots.capacity:
            self.windows = np.zeros((slots.capacity, self.levels, self.width), dtype=np.int64)
            self.bases = np.zeros(slots.capacity, dtype=np.int64)
            self._owner = np.full(slots.capacity, None, dtype=object)
        fresh = rows[self._owner[rows] != slots.requests[rows]]
        if not len(fresh):
            return
        prompt = np.maximum(slots.num_prompt[fresh].astype(np.int64), 1)
        picks = self._rng.random((len(fresh), self.levels, self.width))
        at = (picks * prompt[:, None, None]).astype(np.int64)
        self.windows[fresh] = slots.token_ids[fresh[:, None, None], at]
        self.bases[fresh] = 0
        self._owner[fresh] = slots.requests[fresh]
