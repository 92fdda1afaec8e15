"""LookaheadProposer: the tree it builds (window diagonals, candidate chains) and the Jacobi
iteration filling its pool, checked against a target whose next token depends only on the
token before it, where the right continuation is known."""

from __future__ import annotations

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.draft_tree import branch_drafts, walk_tree
from tokenmill.engine.spec_decode.lookahead import LookaheadProposer


class _Req:
    request_id = "r"


def _slots(prompt: list[int]) -> BatchSlots:
    slots = BatchSlots(capacity=2, max_model_len=4096, block_size=16)
    slots.token_ids[0, : len(prompt)] = prompt
    slots.num_tokens[0] = slots.num_prompt[0] = len(prompt)
    slots.requests[0] = _Req()
    return slots


def test_window_tokens_see_their_diagonal() -> None:
    proposer = LookaheadProposer(ngram=4, window=5, candidates=2)
    slots = _slots([9, 8, 7, 6])
    tree = proposer.propose(slots, np.array([0]))
    base = int(proposer.bases[0])
    assert base == 1  # no candidates yet: the window starts right after t
    parents = tree.parents[0]
    w = 5
    # (level 2, column 3) hangs under (1, 3), (0, 3), then level 0's earlier columns, then t
    node = base + 2 * w + 3
    above = branch_drafts(parents, node)  # draft indices = step index - 1
    want = [base + j - 1 for j in range(3)] + [base + 3 - 1, base + w + 3 - 1, node - 1]
    assert above == want
    assert (tree.tokens[0, : 3 * w] >= 0).all() and (tree.tokens[0, 3 * w :] == -1).all()


def _simulate(steps: int, successor: np.ndarray, prompt: list[int]) -> list[int]:
    """Decode with a target whose sample after token x is successor[x] (greedy and exact):
    returns the tokens kept per step."""
    proposer = LookaheadProposer(ngram=4, window=6, candidates=4, seed=1)
    slots = _slots(prompt)
    rows = np.array([0])
    kept = []
    for _ in range(steps):
        tree = proposer.propose(slots, rows)
        k = int((tree.tokens[0] >= 0).sum())
        n = int(slots.num_tokens[0])
        node_tokens = np.concatenate([[slots.token_ids[0, n - 1]], tree.tokens[0, :k]])
        sampled = successor[node_tokens][None, :]  # [1, 1 + k]
        proposer.observe_samples(slots, rows, sampled, np.array([1 + k]))
        path, accepted = walk_tree(sampled, tree.tokens[:, :k], tree.parents[:, :k],
                                   np.array([k]))  # fmt: skip
        new = sampled[0, path[0, : accepted[0] + 1]]
        # the kept tokens are the target's own continuation
        want = [successor[slots.token_ids[0, n - 1]]]
        for _ in range(len(new) - 1):
            want.append(successor[want[-1]])
        assert new.tolist() == want
        slots.token_ids[0, n : n + len(new)] = new
        slots.num_tokens[0] = n + len(new)
        kept.append(len(new))
    return kept


def test_tree_steps_keep_only_the_targets_tokens() -> None:
    """A target cycling through 40 tokens not in the prompt: every step keeps exactly the
    target's continuation (checked in _simulate), and once the output repeats, the lookup of
    its own earlier occurrence is accepted whole (L drafts + the bonus a step)."""
    rng = np.random.default_rng(0)
    cycle = rng.permutation(np.arange(100, 140))
    successor = np.arange(300)
    successor[cycle] = np.roll(cycle, -1)
    successor[:100] = cycle[0]  # the prompt's tokens lead into the cycle
    kept = _simulate(60, successor, [1, 2, 3, 4, 5])
    assert kept[0] == 1  # the first step has no gram yet
    assert np.mean(kept[-15:]) == 4, kept


def test_window_samples_become_grams_and_the_next_iterate() -> None:
    """After a step, column j's levels and the sample at its top form an n-gram in the pool
    (keyed by its bottom token), and the window moves down one level with the samples on
    top; the next step offers that gram as a candidate when the row's last token is its key."""
    proposer = LookaheadProposer(ngram=3, window=2, candidates=3, seed=0)
    slots = _slots([40, 41, 42, 43])
    rows = np.array([0])
    tree = proposer.propose(slots, rows)
    window = proposer.windows[0].copy()  # [2, 2]
    k = int((tree.tokens[0] >= 0).sum())
    assert k == 4 and proposer.bases[0] == 1
    sampled = np.array([[70, 71, 72, 73, 74]])  # t, (0,0), (0,1), (1,0), (1,1)
    proposer.observe_samples(slots, rows, sampled, np.array([5]))
    for j in range(2):
        gram = [int(window[0, j]), int(window[1, j]), 73 + j]
        assert gram[1:] in proposer.pool.continuations(gram[0])
    assert proposer.windows[0].tolist() == [window[1].tolist(), [73, 74]]
    # a row whose last token is a gram's key gets it as its first candidate
    slots.token_ids[0, 4] = int(window[0, 1])
    slots.num_tokens[0] = 5
    tree = proposer.propose(slots, rows)
    assert tree.tokens[0, :2].tolist() == [int(window[1, 1]), 74]


def test_prompt_lookup_is_a_candidate() -> None:
    """A row repeating its prompt drafts the continuation of the earlier occurrence."""
    proposer = LookaheadProposer(ngram=4, window=2, candidates=2)
    slots = _slots([5, 6, 7, 8, 9, 10, 5, 6])
    tree = proposer.propose(slots, np.array([0]))
    assert tree.tokens[0, :3].tolist() == [7, 8, 9]
    assert tree.parents[0, :3].tolist() == [0, 1, 2]


def test_finished_outputs_feed_the_pool_for_other_rows() -> None:
    """A job's rows share the pool: a finished row's n-grams are candidates for another row
    whose last token starts one; the pool holds pool_keys key places (a key's: key %
    pool_keys), a key taking its place from another."""
    proposer = LookaheadProposer(ngram=3, window=1, candidates=2, pool_keys=10)
    proposer.observe([[50, 51, 52, 53, 54, 55]])  # grams 50-51-52, 51-52-53, .. 53-54-55
    slots = _slots([7, 8, 9, 52])
    tree = proposer.propose(slots, np.array([0]))
    assert tree.tokens[0, :2].tolist() == [53, 54]  # the gram after 52, first
    proposer.observe([[60, 61, 62]])  # 60 takes 50's place (both at 0)
    assert 50 not in proposer.pool and proposer.pool.continuations(60) == [[61, 62]]
    assert proposer.pool.continuations(51) == [[52, 53]]


def _tree_of_one_row(
    proposer: LookaheadProposer, chains: list[list[int]], window: np.ndarray
) -> tuple[list[int], list[int]]:
    """A row's tree built one draft at a time: its candidate chains under t, then its
    window's (l, j) under (l-1, j), or under (0, j-1) and t on level 0."""
    tokens: list[int] = []
    parents: list[int] = []
    for chain in chains[: proposer.candidates]:
        for k, token in enumerate(chain):
            parents.append(0 if k == 0 else len(tokens))  # step index of the draft before
            tokens.append(token)
    base = len(tokens) + 1
    for level in range(proposer.levels):
        for column in range(proposer.width):
            step = base + level * proposer.width + column
            if level:
                parents.append(step - proposer.width)
            else:
                parents.append(0 if column == 0 else step - 1)
            tokens.append(int(window[level, column]))
    pad = proposer.max_drafts - len(tokens)
    return tokens + [-1] * pad, parents + [0] * pad


def test_rows_of_a_step_get_the_trees_they_would_get_alone() -> None:
    """Rows with a prompt match, pool continuations, both or neither, proposed together:
    each row's tree is what a draft-by-draft build of its own candidates and window gives."""
    proposer = LookaheadProposer(ngram=3, window=2, candidates=3, seed=3)
    proposer.observe([[30, 31, 32, 30, 33, 34, 9, 35, 36]])  # 30 -> (31 32), (33 34); 9 -> ..
    prompts = [[5, 6, 7, 5, 6], [1, 2, 30], [1, 2, 3], [9, 1, 9, 1, 9]]
    slots = BatchSlots(capacity=6, max_model_len=64, block_size=16)
    rows = np.array([4, 0, 2, 5])
    for slot, prompt in zip(rows.tolist(), prompts, strict=True):
        slots.token_ids[slot, : len(prompt)] = prompt
        slots.num_tokens[slot] = slots.num_prompt[slot] = len(prompt)
        slots.requests[slot] = _Req()
    tree = proposer.propose(slots, rows)
    matches = {4: [[7, 5]], 0: [], 2: [], 5: [[1, 9]]}  # what followed an earlier 5 6 / 9
    for i, slot in enumerate(rows.tolist()):
        last = int(slots.token_ids[slot, slots.num_tokens[slot] - 1])
        chains = matches[slot] + proposer.pool.continuations(last)
        want = _tree_of_one_row(proposer, chains, proposer.windows[slot])
        assert (tree.tokens[i].tolist(), tree.parents[i].tolist()) == want, slot
    assert proposer.pool.continuations(30) == [[33, 34], [31, 32]]
    # a window is made of the row's own prompt tokens
    for slot, prompt in zip(rows.tolist(), prompts, strict=True):
        assert set(proposer.windows[slot].reshape(-1).tolist()) <= set(prompt)


def test_samples_move_only_the_rows_that_drafted_whole_windows() -> None:
    """observe_samples moves the window of a row whose tree was verified whole; a row cut
    short (fewer step tokens than its tree) or one a new request took meanwhile keeps its
    window and adds no gram."""
    proposer = LookaheadProposer(ngram=3, window=2, candidates=0, seed=0)
    slots = BatchSlots(capacity=3, max_model_len=64, block_size=16)
    for slot in range(3):
        slots.token_ids[slot, :4] = [10 + slot, 20 + slot, 30 + slot, 40 + slot]
        slots.num_tokens[slot] = slots.num_prompt[slot] = 4
        slots.requests[slot] = _Req()
    rows = np.arange(3)
    proposer.propose(slots, rows)
    before = proposer.windows.copy()
    slots.requests[2] = _Req()  # another request took slot 2
    sampled = np.arange(100, 115).reshape(3, 5)  # t, (0,0), (0,1), (1,0), (1,1)
    proposer.observe_samples(slots, rows, sampled, np.array([5, 3, 5]))
    assert proposer.windows[0].tolist() == [before[0, 1].tolist(), [103, 104]]
    assert (proposer.windows[1:] == before[1:]).all()
    assert (proposer.bases[:2] == 0).all()
    grams = {int(before[0, 0, j]): [int(before[0, 1, j]), 103 + j] for j in range(2)}
    for key, cont in grams.items():
        assert cont in proposer.pool.continuations(key)
    assert not any(int(before[1, 0, j]) in proposer.pool for j in range(2))


def test_no_rows_get_an_empty_tree() -> None:
    for candidates in (3, 0):
        proposer = LookaheadProposer(ngram=4, window=5, candidates=candidates)
        tree = proposer.propose(_slots([1, 2, 3]), np.array([], dtype=np.int64))
        assert tree.tokens.shape == (0, proposer.max_drafts)
