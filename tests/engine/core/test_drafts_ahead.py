"""Drafting ahead of a step in flight (core/drafts.py): the window a row's next drafts are
taken from, and how the drafts the device took are installed once the step lands."""

from __future__ import annotations

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.core.drafts import add_drafts, install_ahead
from tokenmill.engine.core.request import Request
from tokenmill.engine.sampling_params import SamplingParams

K = 3


class _Fixed:
    """Predicts ``tokens`` (then nothing) after whatever it is asked about."""

    max_drafts = K

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.asked: list[tuple[int, int]] = []

    def propose(self, slots: BatchSlots, rows: np.ndarray) -> np.ndarray:
        raise AssertionError("a row with a step in flight is drafted ahead")

    def predict(self, slots, rows, count) -> np.ndarray:
        self.asked += [(int(slots.num_tokens[r]), count) for r in rows]
        row = (self.tokens + [-1] * count)[:count]
        return np.array([row] * len(rows), dtype=np.int64)


def _row(params: SamplingParams, known: list[int], in_flight: list[int]) -> BatchSlots:
    """A slot knowing ``known`` (prompt 2 tokens), its last step in flight with these
    drafts (after the known tokens in the token table) and one pending token."""
    slots = BatchSlots(2, 64, 4, ahead_width=2 * K)
    slots.add(Request("r", known[:2], params))
    slots.token_ids[0, : len(known) + len(in_flight)] = known + in_flight
    slots.num_tokens[0] = len(known)
    slots.num_drafts[0] = len(in_flight)
    slots.num_pending[0] = 1
    return slots


def test_the_window_holds_the_predictions_past_the_known_tokens() -> None:
    slots = _row(SamplingParams(max_tokens=50), [1, 2, 3, 4], [10, 11, 12])
    proposer = _Fixed([10, 11, 12, 13, 14, 15, 16])
    got = add_drafts(slots, np.array([0]), np.array([1]), proposer, 100, 64, ahead=True)
    assert got.tolist() == [K]
    assert proposer.asked == [(4, 2 * K + 1)]  # from the known tokens: positions 4 .. 10
    # Column c is position 4 + 1 + c (position 4 is the first draft in flight's).
    assert slots.ahead_window[0].tolist() == [11, 12, 13, 14, 15, 16]
    assert slots.num_ahead[0] == K and slots.num_drafts[0] == 3  # those in flight stay
    # The step in flight accepted one draft (10) and sampled a token of its own after it:
    # the next step's drafts were the window's from offset 1.
    slots.token_ids[0, 4:6] = [10, 99]
    slots.num_tokens[0] = 6
    install_ahead(slots, np.array([0]), np.array([1]))
    assert slots.token_ids[0, 6:9].tolist() == [12, 13, 14]
    assert slots.num_drafts[0] == K and slots.num_ahead[0] == 0


def test_drafts_ahead_stop_where_the_predictions_do() -> None:
    slots = _row(SamplingParams(max_tokens=50), [1, 2, 3, 4], [10, 11])
    # Past the 2 in flight and the bonus token (position 6) only two predictions remain.
    add_drafts(slots, np.array([0]), np.array([1]), _Fixed([10, 11, 12, 13, 14]), 100, 64, True)
    assert slots.num_ahead[0] == 2
    assert slots.ahead_window[0].tolist() == [11, 12, 13, 14, 0, 0]


def test_a_plain_step_in_flight_drafts_past_its_pending_token() -> None:
    slots = _row(SamplingParams(max_tokens=50), [1, 2, 3, 4], [])
    proposer = _Fixed([20, 21, 22, 23])
    add_drafts(slots, np.array([0]), np.array([1]), proposer, 100, 64, ahead=True)
    # 20 is the guess for the pending token itself: the drafts follow it.
    assert slots.ahead_window[0].tolist()[:K] == [21, 22, 23]
    assert slots.num_ahead[0] == K


def test_drafts_ahead_stop_at_max_tokens_and_skip_rows_sampling_by_position() -> None:
    # 2 outputs known + 3 in flight + the bonus: 6 of 8 once all land, room for 1 draft.
    slots = _row(SamplingParams(max_tokens=8), [1, 2, 3, 4], [10, 11, 12])
    add_drafts(slots, np.array([0]), np.array([1]), _Fixed(list(range(20, 30))), 100, 64, True)
    assert slots.num_ahead[0] == 1
    for params in (
        SamplingParams(max_tokens=50, temperature=0.7, seed=3),
        SamplingParams(max_tokens=50, presence_penalty=0.5),
        SamplingParams(max_tokens=50, logprobs=2),
    ):
        slots = _row(params, [1, 2, 3, 4], [10])
        got = add_drafts(slots, np.array([0]), np.array([1]), _Fixed([5, 6]), 100, 64, True)
        assert got.tolist() == [0] and slots.num_ahead[0] == 0
