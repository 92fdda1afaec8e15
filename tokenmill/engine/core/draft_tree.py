"""Draft trees: several candidate continuations of one row, verified in one step.

A linear draft is one guess of the next k tokens. A tree holds several guesses that share
their beginnings (candidate n-grams from different earlier occurrences, Lookahead's pool):

    step tokens:  0=t  1=a  2=b  3=x  4=y  5=c        parents (of 1..5): 0 0 1 3 1
                  t ─┬─ a ─┬─ b
                     │     └─ c
                     └─ x ─── y

Step token 0 is the row's last known token; draft i (1-based) hangs under ``parents[i-1]``,
an earlier step token, so the tokens are in topological order and sit that way in the token
table after the known tokens, each with its own KV slot. A token's RoPE position is the row's
position of t plus its depth; in attention it sees the context and its own ancestors (a bit
mask over the step's tokens, kernels/paged_prefill_attention.py), so its logits are those of
its branch alone.

Verification walks the tree from t: the token sampled at a node picks the child drafted with
that token, if any, and the walk goes on from there; the first sample with no such child is
the bonus token. Sampling each node from the target and following it is exact, as for
linear drafts (drafts.py). The kept tokens' KV stands only where the path runs along the
first branch (node j at step index j); the row recomputes the rest in its next step.

Numpy only. A tree has at most 63 drafts (one mask bit per step token, int64).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "MAX_TREE_DRAFTS",
    "DraftTree",
    "branch_drafts",
    "chain_parents",
    "tree_layout",
    "walk_tree",
]

MAX_TREE_DRAFTS = 63


@dataclass(frozen=True)
class DraftTree:
    """A proposer's trees for R rows: tokens [R, K] (-1 ends a row's drafts) and parents
    [R, K] (``parents[r, i - 1]`` in 0 .. i - 1: the step token draft i hangs under)."""

    tokens: np.ndarray
    parents: np.ndarray

    def __post_init__(self) -> None:
        if self.tokens.shape != self.parents.shape or self.tokens.ndim != 2:
            raise ValueError(
                f"DraftTree: tokens {self.tokens.shape} and parents {self.parents.shape} "
                "must both be [rows, drafts]"
            )
        if self.tokens.shape[1] > MAX_TREE_DRAFTS:
            raise ValueError(f"DraftTree: at most {MAX_TREE_DRAFTS} drafts a row")
        step = np.arange(1, self.tokens.shape[1] + 1)
        used = self.tokens >= 0
        if ((self.parents < 0) | (self.parents >= step))[used].any():
            raise ValueError("DraftTree: draft i's parent must be a step token in 0 .. i - 1")


def chain_parents(rows: int, k: int) -> np.ndarray:
    """[rows, k] the parents of linear drafts: each under the one before."""
    return np.broadcast_to(np.arange(k, dtype=np.int64), (rows, k)).copy()


def branch_drafts(parents: np.ndarray, node: int) -> list[int]:
    """The drafts from the top of step token ``node``'s branch down to it, itself included
    (0-based draft indices), given one row's parents: the output its logits follow besides
    the known tokens (none for t, ``node`` 0)."""
    chain: list[int] = []
    while node > 0:
        chain.append(node - 1)
        node = int(parents[node - 1])
    return chain[::-1]


def tree_layout(parents: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(depth [R, K + 1], masks [R, K + 1] int64) of each row's step tokens: how far below t
    each is, and which step tokens it sees (itself and its ancestors). Entries past a row's
    ``lengths`` drafts are 0."""
    r, k = parents.shape
    depth = np.zeros((r, k + 1), dtype=np.int64)
    masks = np.zeros((r, k + 1), dtype=np.uint64)
    masks[:, 0] = 1
    rows = np.arange(r)
    for i in range(1, k + 1):
        live = i <= lengths
        p = parents[:, i - 1].astype(np.int64)
        p = np.where(live, p, 0)
        depth[:, i] = np.where(live, depth[rows, p] + 1, 0)
        masks[:, i] = np.where(live, masks[rows, p] | np.uint64(1 << i), 0)
    return depth, masks.view(np.int64)


def walk_tree(
    sampled: np.ndarray, drafts: np.ndarray, parents: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(path [R, K + 1]: the step tokens whose samples a row keeps, in order, -1 after;
    accepted [R]: drafts on the path). ``sampled`` [R, K + 1] is what each step token drew,
    ``drafts``/``parents`` [R, K] the trees, ``lengths`` [R] their draft counts."""
    r, k = drafts.shape
    rows = np.arange(r)
    path = np.full((r, k + 1), -1, dtype=np.int64)
    path[:, 0] = 0
    node = np.zeros(r, dtype=np.int64)
    accepted = np.zeros(r, dtype=np.int64)
    going = np.ones(r, dtype=np.bool_)
    live = np.arange(k) < lengths[:, None]  # [R, K]
    for _ in range(k):
        want = sampled[rows, node]  # [R] the token drawn at each row's node
        hit = live & (parents == node[:, None]) & (drafts == want[:, None]) & going[:, None]
        going = hit.any(axis=1)
        if not going.any():
            break
        child = np.argmax(hit, axis=1) + 1  # [R] step index of the matching draft
        node = np.where(going, child, node)
        accepted += going
        path[rows[going], accepted[going]] = child[going]
    return path, accepted
