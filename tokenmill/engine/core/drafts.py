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

Drafting ahead (async scheduling): a row whose previous step is still in flight does not
know its last token, nor, if that step drafted, how many drafts it accepts. It still drafts:
the proposer predicts the tokens after the row's known ones, as far as the step in flight
and this one reach, and the step takes them at the offset the device finds:

    known  [ ... t ]  in flight: t d1 d2 (k = 2)   predicted p0 p1 p2 p3 ... at n, n + 1, ..
    window W = p1 p2 p3 ...  (positions n + 1, ..)
    step n+1, once step n accepted a drafts:   input s_a at position n + a (sampled),
                                               drafts W[a : a + k'] after it

so accepting all gives the predictions after the bonus token, and a rejection at d_{a+1}
keeps the ones after it (a substituted token, as in an edit). The predictions come from the
known tokens only: drafts in flight are often wrong, and a suffix ending in them would
keep a row copying a passage its output has left. The host starts the step at the position
of "all accepted"; the device moves it back by what was not (sampled_rows.py), and the host
learns a with the tokens (``install_ahead``). Rows whose sampling depends on their output
position (a seed; min_tokens, until reached: min_tokens.py) or history (penalties) never
draft ahead.

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
    "PredictsAhead",
    "accepted_counts",
    "add_drafts",
    "draft_lengths",
    "install_ahead",
    "may_draft",
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
class PredictsAhead(Protocol):
    """A proposer that can draft ahead of a step in flight (see the top): ``predict`` gives
    [R, count] int64, the tokens it expects at each row's next ``count`` positions (from
    ``num_tokens`` on: ``propose``'s drafts, as many as asked); -1 where it has none. It
    must not change the slots."""

    max_drafts: int

    def predict(self, slots: BatchSlots, rows: np.ndarray, count: int) -> np.ndarray: ...


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
    ahead: bool = False,
    constrained: bool = True,
) -> np.ndarray:
    """Ask ``proposer`` for drafts for the plain decode rows among ``order`` ([R] slots, each
    computing ``num_new`` tokens); write them after each row's known tokens and return [R]
    how many each row got. Rows that ask for logprobs take none (a step records one
    logprob entry per row); rows with a grammar take none without ``constrained``
    (``may_draft``) and none from a tree of drafts (their masks walk a chain,
    grammar_drafts.py); no drafts go past max_tokens, max_model_len or the step's token
    ``budget``. Penalties follow the drafts: the sampler
    sees each draft position's output as the row's output plus the drafts before it
    (ModelRunner._histories).

    With ``ahead`` (a ``PredictsAhead`` proposer), rows with a step in flight draft ahead
    of it into ``ahead_window`` / ``num_ahead`` (see the top), and rows that sample by
    position or history (a seed, penalties, min_tokens not yet reached) take no drafts at
    all: the step after a drafted
    one starts where only the device knows. (After a step drafted without ``ahead``, which
    the engine processes before the next is scheduled, every row's position is known.)"""
    t = table
    cols = t.sampling.columns
    eligible = (num_new == 1) & may_draft(cols, order, constrained)
    if ahead:  # the next step may start where only the device knows
        eligible &= ~_samples_by_position(cols, order)
        # short of min_tokens: the stop tokens' ban depends on the position (min_tokens.py)
        eligible &= t.min_tokens[order] <= t.num_tokens[order] - t.num_prompt[order]
    else:
        eligible &= t.num_pending[order] == 0
    counts = np.zeros(len(order), dtype=np.int64)
    if not eligible.any():
        return counts
    lagging = eligible & (t.num_pending[order] > 0)
    known = eligible & ~lagging
    k_known = k_ahead = proposal = window = None
    if known.any():
        proposal = proposer.propose(t, order[known])
        k_known = _draft_counts(t, order[known], proposal, proposer.max_drafts, max_model_len, 0)
        if isinstance(proposal, DraftTree):  # a grammar walks a chain of drafts only
            k_known[cols["structured"][order[known]]] = 0
    if lagging.any():
        assert isinstance(proposer, PredictsAhead)
        window, k_ahead = _drafts_ahead(t, order[lagging], proposer, max_model_len)
    total = sum(int(k.sum()) for k in (k_known, k_ahead) if k is not None)
    if int(num_new.sum()) + total > budget:
        return counts
    if k_known is not None:
        _write_drafts(t, order[known], proposal, k_known)
        counts[known] = k_known
    if k_ahead is not None:
        rows = order[lagging]
        t.ahead_window[rows] = window
        t.num_ahead[rows] = k_ahead
        counts[lagging] = k_ahead
    return counts


def may_draft(cols: dict[str, np.ndarray], order: np.ndarray, constrained: bool) -> np.ndarray:
    """[R] rows among ``order`` that may take drafts: not those that ask for logprobs, nor,
    unless ``constrained``, those with a grammar."""
    rows = cols["logprobs"][order] < 0
    if not constrained:
        rows &= ~cols["structured"][order]
    return rows


def _samples_by_position(cols: dict[str, np.ndarray], order: np.ndarray) -> np.ndarray:
    """[R] rows whose sampling reads their output position (a seed, when not greedy) or
    their output history (penalties)."""
    seeded = cols["has_seed"][order] & ~cols["greedy"][order]
    penalized = (
        (cols["presence_penalty"][order] != 0)
        | (cols["frequency_penalty"][order] != 0)
        | (cols["repetition_penalty"][order] != 1)
    )
    return seeded | penalized


def _draft_counts(
    t: BatchSlots,
    rows: np.ndarray,
    proposal: np.ndarray | DraftTree,
    max_drafts: int,
    max_model_len: int,
    extra: int | np.ndarray,
) -> np.ndarray:
    """[R] drafts each row takes of ``proposal``: its leading ones, within max_tokens and
    max_model_len once the row holds ``extra`` more tokens than it knows."""
    drafts = np.asarray(proposal.tokens if isinstance(proposal, DraftTree) else proposal)
    n = t.num_tokens[rows].astype(np.int64) + extra
    room = np.minimum(t.max_tokens[rows] - (n - t.num_prompt[rows]), max_model_len - n)
    return np.clip(np.minimum(draft_lengths(drafts[:, :max_drafts]), room - 1), 0, None)


def _write_drafts(
    t: BatchSlots, rows: np.ndarray, proposal: np.ndarray | DraftTree, k: np.ndarray
) -> None:
    """Write each row's first ``k`` drafts after its known tokens (a tree's shape too)."""
    tree = isinstance(proposal, DraftTree)
    drafts = np.asarray(proposal.tokens if tree else proposal, dtype=np.int64)
    n = t.num_tokens[rows].astype(np.int64)
    r, j = np.nonzero(np.arange(drafts.shape[1]) < k[:, None])
    t.token_ids[rows[r], n[r] + j] = drafts[r, j]
    t.num_drafts[rows] = k
    if tree:  # a tree cut after k drafts is still one (parents come first)
        parents = np.asarray(proposal.parents, dtype=np.int64)[:, : drafts.shape[1]]
        t.draft_parent[rows[r], j] = parents[r, j]
        step = np.arange(parents.shape[1])
        chain = (parents == step) | (step >= k[:, None])  # each draft under the one before
        t.draft_tree[rows] = (k > 0) & ~chain.all(axis=1)


def _drafts_ahead(
    t: BatchSlots, rows: np.ndarray, proposer: PredictsAhead, max_model_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """(window [R, W], drafts [R]) of rows with a step in flight (see the top): W holds the
    predicted tokens at positions n + 1 .. of a row knowing n tokens; unknown ones are 0 (a
    draft the device may pick, verified like any other)."""
    k_max = proposer.max_drafts
    width = t.ahead_window.shape[1]
    in_flight = t.num_drafts[rows].astype(np.int64)
    predicted = proposer.predict(t, rows, width + 1)  # positions n .. n + W
    # All accepted, the step's drafts are the predictions after the bonus token.
    after = np.take_along_axis(predicted, in_flight[:, None] + 1 + np.arange(k_max), axis=1)
    k = _draft_counts(t, rows, after, k_max, max_model_len, in_flight + 1)
    return np.maximum(predicted[:, 1:], 0), k


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
    # k is the step's most drafts: a row with fewer may end short of k columns before the
    # table's end, and its columns past its own drafts are never compared
    at = np.minimum(n[:, None] + np.arange(k), table.token_ids.shape[1] - 1)
    drafts = table.token_ids[slots[:, None], at]
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
    # Back by the drafts whose KV does not stand (a step scheduled ahead, if any, counted
    # on all of them).
    table.num_computed[slots[drafted]] -= (counts[drafted] - 1 - stands[drafted]).astype(np.int32)
    table.num_drafts[slots] = 0
    return accepted + 1, accepted, sampled


def install_ahead(table: BatchSlots, slots: np.ndarray, accepted: np.ndarray) -> None:
    """After the slots' step in flight is applied (it accepted ``accepted`` drafts [R]):
    the drafts of the step scheduled ahead of it become the rows' drafts in flight, the
    ones its device took (from ``ahead_window`` at offset ``accepted``)."""
    k = table.num_ahead[slots].astype(np.int64)
    ahead = np.flatnonzero(k)
    if not len(ahead):
        return
    rows, k, a = slots[ahead], k[ahead], accepted[ahead].astype(np.int64)
    n = table.num_tokens[rows].astype(np.int64)
    r, j = np.nonzero(np.arange(int(k.max())) < k[:, None])
    table.token_ids[rows[r], n[r] + j] = table.ahead_window[rows[r], a[r] + j]
    table.num_drafts[rows] = k
    table.num_ahead[rows] = 0
