"""NgramProposer: the latest earlier occurrence of the longest matching suffix, against a
brute-force search, and its index kept per slot as tokens arrive."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.spec_decode.ngram import NgramProposer


def _slots(rows: list[list[int]], capacity: int = 8, max_len: int = 256) -> BatchSlots:
    slots = BatchSlots(capacity, max_len, 16)
    for i, tokens in enumerate(rows):
        _put(slots, i, tokens, owner=object())
    return slots


def _put(slots: BatchSlots, slot: int, tokens: list[int], owner: object | None = None) -> None:
    slots.token_ids[slot, : len(tokens)] = tokens
    slots.num_tokens[slot] = len(tokens)
    if owner is not None:
        slots.requests[slot] = owner


def _brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    n = len(tokens)
    for m in range(max_n, min_n - 1, -1):
        if n <= m:
            continue
        suffix = tokens[n - m :]
        for end in range(n - 2, m - 2, -1):  # latest earlier occurrence first
            if tokens[end - m + 1 : end + 1] == suffix:
                cycle = tokens[end + 1 :]  # past the known tokens, the row repeats it
                return [cycle[j % len(cycle)] for j in range(k)]
    return [-1] * k


def _propose(proposer: NgramProposer, slots: BatchSlots, rows: list[int]) -> list[list[int]]:
    return proposer.propose(slots, np.array(rows)).tolist()


def test_drafts_what_followed_the_suffix() -> None:
    # "the cat sat on the mat . the cat" -> "sat on the"
    the, cat, sat, on, mat, dot = 1, 2, 3, 4, 5, 6
    slots = _slots([[the, cat, sat, on, the, mat, dot, the, cat]])
    assert _propose(NgramProposer(3), slots, [0]) == [[sat, on, the]]


def test_longest_suffix_wins_then_the_latest_occurrence() -> None:
    # 3-gram (1 2 3) ended at 2 -> 9 5 2; the 2-gram (2 3) ended later, at 6, but is shorter.
    slots = _slots([[1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3], [1, 2, 7, 1, 2, 8, 1, 2]])
    got = _propose(NgramProposer(3, min_n=2, max_n=3), slots, [0, 1])
    assert got == [[9, 5, 2], [8, 1, 2]]  # row 1: the latest (1 2) ended at 4


def test_drafts_repeat_the_cycle_past_the_known_tokens_and_none_without_a_match() -> None:
    slots = _slots([[4, 5, 6, 4, 5], [1, 2, 3, 4], [7]])
    got = _propose(NgramProposer(5, min_n=2, max_n=2), slots, [0, 1, 2])
    assert got == [[6, 4, 5, 6, 4], [-1] * 5, [-1] * 5]


def test_new_tokens_are_indexed_and_a_new_request_resets_the_slot() -> None:
    proposer = NgramProposer(2, min_n=2, max_n=2)
    slots = _slots([[1, 2, 3]])
    assert _propose(proposer, slots, [0]) == [[-1, -1]]
    _put(slots, 0, [1, 2, 3, 4, 1, 2])  # the same request, three tokens later
    assert _propose(proposer, slots, [0]) == [[3, 4]]
    _put(slots, 0, [9, 9, 1, 2], owner=object())  # another request took the slot
    assert _propose(proposer, slots, [0]) == [[-1, -1]]  # nothing of the old tokens


@pytest.mark.parametrize("vocab", [3, 20])
def test_matches_brute_force_on_random_rows(vocab: int) -> None:
    """Rows grow a few tokens a call (as decode steps do, drafts accepted or not); every
    call equals the brute-force search. A wide index: no hash collision at these sizes."""
    rng = np.random.default_rng(vocab)
    capacity, k = 8, 4
    proposer = NgramProposer(k, min_n=1, max_n=4, table_bits=20)
    slots = BatchSlots(capacity, 512, 16)
    rows = [rng.integers(0, vocab, rng.integers(1, 40)).tolist() for _ in range(capacity)]
    for slot, tokens in enumerate(rows):
        _put(slots, slot, tokens, owner=object())
    for _ in range(30):
        asked = sorted(rng.choice(capacity, rng.integers(1, capacity + 1), replace=False))
        got = _propose(proposer, slots, asked)
        assert got == [_brute_force(rows[s], k, 1, 4) for s in asked]
        for slot in asked:
            rows[slot] += rng.integers(0, vocab, rng.integers(1, 4)).tolist()
            _put(slots, slot, rows[slot])


def test_a_crowded_index_never_gives_a_false_match() -> None:
    """A table of 4 entries a slot: nearly every lookup lands on an entry another gram wrote.
    Each match reported is a real earlier occurrence of the row's suffix (the entry's print
    told the grams apart), and some are found."""
    rng = np.random.default_rng(0)
    proposer = NgramProposer(3, min_n=2, max_n=4, table_bits=2)
    rows = [rng.integers(0, 5, 60).tolist() for _ in range(8)]
    slots = _slots(rows)
    found = 0
    for _ in range(40):
        start, length = proposer.match(slots, np.arange(8))
        for row, s, m in zip(rows, start.tolist(), length.tolist(), strict=True):
            if s >= 0:
                found += 1
                assert 0 < s < len(row) and row[s - m : s] == row[len(row) - m :]
        for slot, row in enumerate(rows):
            row += rng.integers(0, 5, 2).tolist()
            _put(slots, slot, row)
    assert found > 20


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="max_drafts"):
        NgramProposer(0)


def test_predicts_as_far_as_asked() -> None:
    slots = _slots([[1, 2, 3, 4, 5, 6, 7, 1, 2]])
    proposer = NgramProposer(2, min_n=2, max_n=2)
    assert proposer.predict(slots, np.array([0]), 9).tolist() == [[3, 4, 5, 6, 7, 1, 2, 3, 4]]
    assert _propose(proposer, slots, [0]) == [[3, 4]]
