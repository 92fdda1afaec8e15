"""min_tokens bans a row's stop tokens (EOS unless ignored, and stop_token_ids) while the
row is short of it: per logits row, so a drafted row's later positions are free sooner."""

from __future__ import annotations

import numpy as np

from tokenmill.engine.core.batch_slots import BatchSlots
from tokenmill.engine.min_tokens import banned_stop_tokens

V = 100


def _table() -> BatchSlots:
    t = BatchSlots(4, 64, 16)
    t.min_tokens[:] = [3, 0, 5, 2]
    t.ignore_eos[:] = [False, False, True, False]
    t.eos_ids = np.array([[2], [2], [2], [2]])
    t.stop_ids = np.array([[7, -1], [-1, -1], [9, 11], [-1, -1]])
    return t


def test_rows_short_of_min_tokens_ban_their_stop_tokens() -> None:
    t = _table()
    # logits rows: slot 0 at outputs 1, 2, 3 (a drafted row); slot 1 at 0; slot 2 at 4;
    # slot 3 at 2
    row_slots = np.array([0, 0, 0, 1, 2, 3])
    positions = np.array([1, 2, 3, 0, 4, 2])
    banned = banned_stop_tokens(t, row_slots, positions, V)
    assert sorted(banned.tolist()) == sorted(
        [0 * V + 2, 0 * V + 7, 1 * V + 2, 1 * V + 7, 4 * V + 9, 4 * V + 11]
    )  # slot 2 ignores EOS; slot 0's third position and slot 3 have their min_tokens


def test_nothing_is_banned_once_every_row_has_its_min_tokens() -> None:
    t = _table()
    assert banned_stop_tokens(t, np.array([0, 2, 3]), np.array([3, 5, 9]), V) is None
