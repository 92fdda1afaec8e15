"""ReorderWindow: longest predicted work first, no item later than ``window`` pops behind
input order, memory bounded however long the stream."""

from __future__ import annotations

import random

import pytest

from tokenmill.scheduling.reorder_window import ReorderWindow


def _stream(works: list[float], window: int, hold: int, by_length: bool = True) -> list[int]:
    """Push items (their input positions) while fewer than ``hold`` wait, pop one, repeat;
    the pop order."""
    win: ReorderWindow[int] = ReorderWindow(window, by_length)
    out: list[int] = []
    pushed = 0
    while len(out) < len(works):
        while pushed < len(works) and len(win) < hold:
            win.push(pushed, works[pushed])
            pushed += 1
        out.append(win.pop())
    return out


def test_the_longest_goes_first_and_ties_keep_input_order() -> None:
    win: ReorderWindow[str] = ReorderWindow(window=10)
    for name, work in [("a", 5), ("b", 50), ("c", 5), ("d", 20), ("e", 50)]:
        win.push(name, work)
    assert win.pop_many(10) == ["b", "e", "d", "a", "c"]
    assert len(win) == 0
    with pytest.raises(IndexError):
        win.pop()


def test_no_item_leaves_more_than_window_pops_late() -> None:
    rng = random.Random(0)
    works = [rng.choice([1, 1, 1, 8, 300]) + rng.random() for _ in range(5000)]
    for window, hold in [(1, 1), (16, 16), (64, 64), (64, 200)]:
        order = _stream(works, window, hold)
        assert sorted(order) == list(range(len(works)))  # each item exactly once
        lateness = max(pos - seq for pos, seq in enumerate(order))
        assert lateness <= window, (window, hold, lateness)


def test_long_items_move_ahead_of_short_ones() -> None:
    """Short rows with a long one every 50: the long ones leave about a window early."""
    works = [300.0 if i % 50 == 49 else 1.0 for i in range(2000)]
    order = _stream(works, window=64, hold=64)
    position = {seq: pos for pos, seq in enumerate(order)}
    long_items = [i for i, w in enumerate(works) if w > 1]
    assert all(position[i] <= i - 60 for i in long_items[2:])


def test_input_order_is_a_fifo() -> None:
    works = [random.Random(1).random() for _ in range(100)]
    assert _stream(works, window=8, hold=8, by_length=False) == list(range(100))


def test_memory_stays_bounded_when_short_items_leave_by_deadline() -> None:
    """A stream where every short item leaves by its deadline (longer ones keep coming):
    the heap's stale entries are dropped, so it stays within a few times the window."""
    win: ReorderWindow[int] = ReorderWindow(window=32)
    most = 0
    for i in range(20_000):
        win.push(i, float(i))  # each newer item has more work: older ones only age out
        if len(win) >= 32:
            win.pop()
        most = max(most, len(win._heap), len(win._order))
    assert most <= 2 * 32 + 64 + 1


def test_a_window_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="window must be >= 1"):
        ReorderWindow(0)
