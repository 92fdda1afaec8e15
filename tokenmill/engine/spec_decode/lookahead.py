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

Each step adds W such grams to the pool (key: the first token; the newest G continuations
of a key kept), then the window moves one level down and its top level becomes the top
level's samples (the next Jacobi iterate). The pool is the engine's, shared by all rows (a
job's rows often say the same things), bounded to ``pool_keys`` keys (the least recently
fed go first), and the outputs of finished rows feed it too (``observe``).

Candidates and window are verified alike: the row keeps the path its samples follow
through the tree, so output is exactly the target's. A new row's window starts from random
tokens of its prompt.

Per-row numpy work, meant for small batches, where a step has room for W*L + G*L extra
tokens a row at about a plain step's cost (a GPU's memory-bound decode); it drafts on every
step it is chosen for.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.draft_tree import MAX_TREE_DRAFTS, DraftTree
from tokenmill.engine.spec_decode.ngram import NgramProposer

__all__ = ["LookaheadProposer"]


@dataclass
class _Row:
    """One request's window [L, W] and where it sat in the last step's tree (0: none)."""

    request: object
    window: np.ndarray
    base: int = 0


class LookaheadProposer:
    makes_trees = True  # the engine captures CUDA graphs for its tree steps

    def __init__(
        self,
        ngram: int = 4,
        window: int = 5,
        candidates: int = 5,
        seed: int = 0,
        pool_keys: int = 1 << 16,
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
        self._rows: dict[int, _Row] = {}  # by slot
        self._lookup = NgramProposer(levels) if candidates else None
        # first token -> its continuations [L] (newest last); keys in order of last feeding
        self._pool: OrderedDict[int, OrderedDict[bytes, np.ndarray]] = OrderedDict()
        self.pool_keys = pool_keys

    def propose(self, slots: BatchSlots, rows: np.ndarray) -> DraftTree:
        """A tree per row in ``rows`` (slots): the pool's candidates for its last token,
        then its window (see the top)."""
        lv, w = self.levels, self.width
        rows = np.asarray(rows, dtype=np.int64)
        tokens = np.full((len(rows), self.max_drafts), -1, dtype=np.int64)
        parents = np.zeros((len(rows), self.max_drafts), dtype=np.int64)
        looked_up = None if self._lookup is None else self._lookup.propose(slots, rows)
        for i, slot in enumerate(rows.tolist()):
            row = self._row(slots, slot)
            n = int(slots.num_tokens[slot])
            last = int(slots.token_ids[slot, n - 1])
            conts = list(self._pool.get(last, {}).values())[::-1]
            if looked_up is not None and looked_up[i, 0] >= 0:  # what followed a match
                conts.insert(0, looked_up[i][looked_up[i] >= 0])
            at = 0  # the next free draft index
            for cont in conts[: self.candidates]:  # chains under t
                m = len(cont)
                tokens[i, at : at + m] = cont
                parents[i, at : at + m] = at + np.arange(m)
                parents[i, at] = 0
                at += m
            base = at + 1  # the window's first step index
            tokens[i, at : at + lv * w] = row.window.reshape(-1)
            idx = base + np.arange(lv * w)  # step index of (l, j): base + l*W + j
            level, column = np.divmod(idx - base, w)
            parents[i, at : at + lv * w] = np.where(
                level == 0, np.where(column == 0, 0, idx - 1), idx - w
            )
            row.base = base
        return DraftTree(tokens, parents)

    def observe_samples(
        self, slots: BatchSlots, rows: np.ndarray, sampled: np.ndarray, counts: np.ndarray
    ) -> None:
        """What each drafted row ([R] slots) sampled at its step tokens ([R, M], ``counts``
        of them): grams from the window's top level into the pool, then the window moves."""
        lv, w = self.levels, self.width
        for i, slot in enumerate(np.asarray(rows).tolist()):
            row = self._rows.get(slot)
            if row is None or row.base == 0 or row.request is not slots.requests[slot]:
                continue
            top = row.base + (lv - 1) * w  # step index of (L-1, 0)
            if counts[i] < top + w:  # the tree was cut short (near max_tokens)
                row.base = 0
                continue
            new = np.asarray(sampled[i, top : top + w], dtype=np.int64)
            grams = np.vstack([row.window, new[None, :]])  # [L + 1, W]: a gram per column
            for j in range(w):
                self._remember(int(grams[0, j]), grams[1:, j])
            row.window = np.vstack([row.window[1:], new[None, :]])
            row.base = 0

    def observe(self, outputs: list[list[int]]) -> None:
        """Outputs of requests that just finished: each n-gram of them joins the pool."""
        lv = self.levels
        for out in outputs:
            tokens = np.asarray(out, dtype=np.int64)
            if len(tokens) <= lv:
                continue
            grams = np.lib.stride_tricks.sliding_window_view(tokens, lv + 1)
            for gram in grams:
                self._remember(int(gram[0]), gram[1:])

    def _remember(self, first: int, cont: np.ndarray) -> None:
        conts = self._pool.pop(first, None)
        if conts is None:
            conts = OrderedDict()
            if len(self._pool) >= self.pool_keys:
                self._pool.popitem(last=False)  # the key fed least recently
        self._pool[first] = conts
        key = cont.tobytes()
        conts.pop(key, None)
        conts[key] = cont.copy()  # newest last
        while len(conts) > max(self.candidates, 1):
            conts.popitem(last=False)

    def _row(self, slots: BatchSlots, slot: int) -> _Row:
        """The slot's state, started afresh when another request holds the slot now."""
        req = slots.requests[slot]
        row = self._rows.get(slot)
        if row is None or row.request is not req:
            prompt = slots.token_ids[slot, : max(int(slots.num_prompt[slot]), 1)]
            window = self._rng.choice(prompt, size=(self.levels, self.width)).astype(np.int64)
            row = self._rows[slot] = _Row(req, window)
        return row
