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

A proposer may also give a tree of drafts (several candidates sharing their beginnings,
draft_tree.py): the row computes all of them in one step and keeps the path its samples
follow.

Numpy, no torch: the scheduler calls add_drafts when it schedules a step and verify_drafts
when the step's tokens come back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from tokenmill.engine.core.draft_tree import DraftTree, walk_tree

if TYPE_CHECKING:
    from tokenmill.engine.core.batch_slots import BatchSlots

__all__ = [
    "DraftProposer",
    "ObservesSamples",
    "accepted_counts",
    "add_drafts",
    "draft_lengths",
    "verify_drafts",
]


class DraftProposer(Protocol):
    """Proposes up to ``max_drafts`` tokens per row from what the slots hold.

    ``propose`` gets the batch slots and the slots ([R]) of rows that may take drafts (decode
    rows whose tokens are all known on the host) and returns [R, max_drafts] int64 token ids;
    -1 ends a row's drafts (a row's drafts are the entries before its first -1). It must not
    change the slots, and its cost is on every step's host path: vectorize it.
    """

    max_drafts: int

    def propose(self, slots: BatchSlots, rows: np.ndarray) -> np.ndarray | DraftTree: ...


@runtime_checkable
class ObservesSamples(Protocol):
    """A proposer that learns from what its drafted rows sampled at every step token (the
    window of Lookahead): called with the step's raw samples [R, M] before verification."""

    def observe_samples(
        self, slots: BatchSlots, rows: np.ndarray, sampled: np.ndarray, counts: np.ndarray
    ) -> None: ...


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


def add_drafts(
    table: BatchSlots,
    order: np.ndarray,
    num_new: np.ndarray,
    proposer: DraftProposer,
    budget: int,
    max_model_len: int,
) -> np.ndarray:
    """Ask ``proposer`` for drafts for the plain decode rows among ``order`` ([R] slots, each
    computing ``num_new`` tokens); write them after each row's known tokens and return [R]
    how many each row got. Rows that ask for logprobs take none (a step records one
    logprob entry per row), nor do rows with a grammar (structured output: the mask at a
    position needs the tokens before it consumed), nor do drafts go past max_tokens,
    max_model_len or the step's token ``budget``. Penalties follow the drafts: the sampler
    sees each draft position's output as the row's output plus the drafts before it
    (ModelRunner._histories)."""
    t = table
    cols = t.sampling.columns
    eligible = (
        (num_new == 1)
        & (t.num_pending[order] == 0)
        & (cols["logprobs"][order] < 0)
        & ~cols["structured"][order]
    )
    counts = np.zeros(len(order), dtype=np.int64)
    rows = order[eligible]
    if not len(rows):
        return counts
    proposal = proposer.propose(t, rows)
    tree = isinstance(proposal, DraftTree)
    drafts = np.asarray(proposal.tokens if tree else proposal, dtype=np.int64)
    drafts = drafts[:, : proposer.max_drafts]
    n = t.num_tokens[rows].astype(np.int64)
    room = np.minimum(t.max_tokens[rows] - (n - t.num_prompt[rows]), max_model_len - n)
    k = np.clip(np.minimum(draft_lengths(drafts), room - 1), 0, None)
    if int(num_new.sum() + k.sum()) > budget:
        return counts
    r, j = np.nonzero(np.arange(drafts.shape[1]) < k[:, None])
    t.token_ids[rows[r], n[r] + j] = drafts[r, j]
    t.num_drafts[rows] = k
    if tree:  # a tree cut after k drafts is still one (parents come first)
        parents = np.asarray(proposal.parents, dtype=np.int64)[:, : drafts.shape[1]]
        t.draft_parent[rows[r], j] = parents[r, j]
        step = np.arange(parents.shape[1])
        chain = (parents == step) | (step >= k[:, None])  # each draft under the one before
        t.draft_tree[rows] = (k > 0) & ~chain.all(axis=1)
    counts[eligible] = k
    return counts


def verify_drafts(
    table: BatchSlots, slots: np.ndarray, sampled: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check the slots' drafts (in the token table after their known tokens) against what
    they sampled ([R, K + 1]; row r sampled ``counts[r]`` = 1 + its drafts). Returns (tokens
    each row keeps: its accepted drafts + 1, accepted drafts) [R] and the kept tokens
    [R, K + 1] (for a chain, ``sampled`` itself; for a tree, the samples along its path);
    rolls each drafted row's computed count back to the KV that stands and clears the
    slots' drafts."""
    n = table.num_tokens[slots].astype(np.int64)
    k = sampled.shape[1] - 1
    drafts = table.token_ids[slots[:, None], n[:, None] + np.arange(k)]
    accepted = accepted_counts(sampled, drafts, counts - 1)
    stands = accepted.copy()  # kept tokens whose KV is in place
    tree = np.flatnonzero(table.draft_tree[slots] & (counts > 1))
    if len(tree):
        sampled = sampled.copy()
        parents = table.draft_parent[slots[tree], :k].astype(np.int64)
        path, accepted[tree] = walk_tree(sampled[tree], drafts[tree], parents, counts[tree] - 1)
        in_place = np.cumprod(path[:, 1:] == np.arange(1, k + 1), axis=1).sum(axis=1)
        stands[tree] = np.minimum(in_place, accepted[tree])
        sampled[tree] = np.take_along_axis(sampled[tree], np.maximum(path, 0), axis=1)
        table.draft_tree[slots[tree]] = False
    drafted = counts > 1
    table.num_computed[slots[drafted]] = n[drafted] + stands[drafted]
    table.num_drafts[slots] = 0
    return accepted + 1, accepted, sampled
