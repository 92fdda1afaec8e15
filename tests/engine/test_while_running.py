"""WhileRunning: applied when the first run starts, undone with what apply returned when the
last one ends, across nesting and threads."""

from __future__ import annotations

import threading

import pytest

from tokenmill.engine.while_running import WhileRunning


def _recording() -> tuple[WhileRunning, list[str]]:
    events: list[str] = []
    count = iter(range(100))

    def apply() -> int:
        n = next(count)
        events.append(f"apply {n}")
        return n

    return WhileRunning(apply, lambda n: events.append(f"undo {n}")), events


def test_nested_runs_apply_once_and_undo_with_the_applied_value() -> None:
    held, events = _recording()
    with held():
        with held():
            assert events == ["apply 0"]
        assert events == ["apply 0"]
    assert events == ["apply 0", "undo 0"]
    with held():
        pass
    assert events == ["apply 0", "undo 0", "apply 1", "undo 1"]


def test_a_run_in_another_thread_keeps_it_applied_until_it_ends() -> None:
    held, events = _recording()
    entered, release = threading.Event(), threading.Event()

    def other_run() -> None:
        with held():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other_run)
    with held():
        thread.start()
        assert entered.wait(10)
    assert events == ["apply 0"]  # the first run ended first: still applied
    release.set()
    thread.join(10)
    assert events == ["apply 0", "undo 0"]


def test_a_run_that_raises_still_undoes() -> None:
    held, events = _recording()
    with pytest.raises(RuntimeError), held():
        raise RuntimeError("the loop failed")
    assert events == ["apply 0", "undo 0"]
