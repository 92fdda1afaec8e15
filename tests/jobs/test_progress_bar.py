"""The progress bar on a terminal: Progress driven by a fake clock and fake live counts, drawn
on a fake terminal (a StringIO that says it is a TTY); what it draws is read back."""

from __future__ import annotations

import io
import logging
import re
import sys
from collections.abc import Iterator

import pytest

from tokenmill.jobs.progress import LiveCounts, Progress, format_duration


class FakeTerminal(io.StringIO):
    """A stream that reports being a terminal, keeping what is written to it."""

    def isatty(self) -> bool:
        return True

    def frames(self) -> list[str]:
        """Each redraw of the bar (tqdm starts each with a carriage return)."""
        return [f.rstrip("\n") for f in self.getvalue().split("\r") if f.strip()]


@pytest.fixture
def term() -> Iterator[FakeTerminal]:
    """A fake terminal; the bars drawn on it are closed after the test (tqdm stacks the bars
    still open one above the other, with cursor moves, as it would on a real terminal)."""
    stream = FakeTerminal()
    yield stream
    for progress in Driver.made:
        progress.close()
    Driver.made.clear()


class Driver:
    """A fake clock and an engine generating at a steady rate, ticked once a second."""

    made: list[Progress] = []

    def __init__(self, total: int | None, done: int, stream: io.StringIO) -> None:
        self.now = 100.0
        self.counts = LiveCounts()
        self.progress = Progress(
            total, done, live=lambda: self.counts, clock=lambda: self.now, stream=stream
        )
        Driver.made.append(self.progress)

    def run(self, seconds: int, tok_per_s: int, rows_per_s: int = 0, in_flight: int = 8) -> None:
        for _ in range(seconds):
            self.now += 1.0
            self.counts = LiveCounts(self.counts.output_tokens + tok_per_s, in_flight)
            if rows_per_s:
                self.progress.update(rows_per_s, 0)
            else:
                self.progress.tick()


def test_the_bar_shows_rows_rate_and_eta_from_the_progress_model(
    term: FakeTerminal, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "tokenmill.jobs")
    drive = Driver(total=2000, done=120, stream=term)  # 120 rows committed by an earlier run
    drive.run(seconds=60, tok_per_s=1650, rows_per_s=2, in_flight=256)
    progress = drive.progress
    last = term.frames()[-1]
    # the model's numbers, as the model formats them: 120 rows this run, 1,760 left at 2/s
    assert progress.done == 240 and progress.tokens_per_s == pytest.approx(1650)
    assert progress.eta_seconds == pytest.approx(880)
    assert last.startswith(" 12%|")
    assert last.endswith(
        f"| 240 of 2,000 rows, 1,650 output tok/s, ETA {format_duration(880)}, 256 in flight"
    )
    assert "ETA 14 min 40 s" in last
    # tqdm's own rows/s and remaining time (finished rows only) are not shown
    assert "row/s" not in term.getvalue() and "<" not in last
    assert not caplog.records  # the bar replaces the log lines
    progress.close()
    assert term.getvalue().endswith("\n")  # the bar's last state stays on screen


def test_before_any_rate_the_bar_says_so(term: FakeTerminal) -> None:
    drive = Driver(total=50, done=0, stream=term)
    drive.progress.tick()  # no time has passed: no sample yet
    drive.now += 1.0
    drive.progress.tick()  # a sample of no tokens: no rate (nothing heard yet)
    assert term.frames()[-1].endswith(
        "| 0 of 50 rows, output tok/s: measuring, ETA unknown, 0 in flight"
    )


def test_without_a_row_count_the_bar_is_text_only(term: FakeTerminal) -> None:
    drive = Driver(total=None, done=0, stream=term)
    drive.run(seconds=10, tok_per_s=300, rows_per_s=1, in_flight=4)
    drive.progress.finish()
    assert term.frames()[-1] == "10 rows, 300 output tok/s, ETA unknown, 0 in flight"


def test_no_terminal_keeps_the_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    stream = io.StringIO()  # not a terminal: a log file, a pipe, Airflow's log capture
    caplog.set_level(logging.INFO, "tokenmill.jobs")
    drive = Driver(total=100, done=0, stream=stream)
    drive.run(seconds=10, tok_per_s=50, rows_per_s=1)
    drive.progress.close()
    assert stream.getvalue() == ""
    (record,) = caplog.records
    assert record.getMessage() == (
        "10 of 100 rows done (10%), 8 in flight, 500 output tokens so far, 50 output tok/s, "
        "ETA 1 min 30 s"
    )


def test_a_disabled_progress_draws_nothing_even_on_a_terminal(term: FakeTerminal) -> None:
    now = [0.0]
    progress = Progress(10, 0, enabled=False, clock=lambda: now[0], stream=term)
    for _ in range(5):
        now[0] += 1
        progress.update(1, 3)
    progress.close()
    assert term.getvalue() == ""


def test_a_log_record_during_the_run_is_printed_above_the_bar(
    term: FakeTerminal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run-job logs to stderr (logging.basicConfig): a warning while the bar is up must not
    land in the middle of the bar's line."""
    monkeypatch.setattr(sys, "stderr", term)
    console = logging.StreamHandler(term)
    root = logging.getLogger()
    root.addHandler(console)
    try:
        drive = Driver(total=10, done=0, stream=sys.stderr)
        drive.run(seconds=2, tok_per_s=40, rows_per_s=1)
        logging.getLogger("tokenmill.jobs").warning("Ray replica 2 of 2 loaded the model in 3.0 s")
        drive.run(seconds=2, tok_per_s=40, rows_per_s=1)
        assert console not in root.handlers  # printed through tqdm while the bar is up
        drive.progress.close()
        assert console in root.handlers  # and put back when it closes
    finally:
        root.removeHandler(console)
    # the bar's line blanked, the record on a line of its own, then the bar drawn again below
    drawn = term.getvalue()
    assert re.search(r"\r +\rRay replica 2 of 2 loaded the model in 3\.0 s\n\r 20%\|", drawn)
    assert drawn.count("loaded the model") == 1
    assert term.frames()[-1].endswith("| 4 of 10 rows, 40 output tok/s, ETA 6 s, 8 in flight")


def test_a_terminal_without_a_width_gets_log_lines() -> None:
    """A pseudo-terminal with no window size (``script`` in some CI runners and containers)
    says it is 0 columns wide: the bar drew nothing there, for the whole run."""
    import os

    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as stream:
        assert stream.isatty() and os.get_terminal_size(follower).columns == 0
        progress = Progress(10, 0, stream=stream)
        assert progress._bar is None  # the periodic log lines instead
        progress.close()
    os.close(leader)


def test_a_terminal_with_columns_and_no_rows_gets_log_lines() -> None:
    """``stty cols 150`` on such a terminal sets its width alone: tqdm drew nothing on a
    terminal 0 rows high, and no log line came either, for the whole run."""
    import fcntl
    import os
    import struct
    import termios

    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 150, 0, 0))
    with os.fdopen(follower, "w") as stream:
        size = os.get_terminal_size(follower)
        assert (size.columns, size.lines) == (150, 0)
        progress = Progress(10, 0, stream=stream)
        assert progress._bar is None
        progress.close()
    os.close(leader)


def test_a_total_counted_later_brings_the_bar_and_an_estimate_reads_as_one(
    term: FakeTerminal,
) -> None:
    """The run starts before its rows are counted (the count runs beside it): text only,
    then the bar once an estimate comes (remote JSONL, row_estimate.py), marked "~", then
    the counted total; an estimate never replaces a count, nor is it the snapshot's total."""
    from tokenmill.jobs.row_estimate import RowTotal

    drive = Driver(total=None, done=0, stream=term)
    drive.run(seconds=3, tok_per_s=300, rows_per_s=1)
    assert term.frames()[-1].startswith("3 rows, ")
    drive.progress.set_total(RowTotal(12_300, estimated=True))
    drive.run(seconds=2, tok_per_s=300, rows_per_s=1)
    assert "| 5 of ~12,300 rows, 300 output tok/s, ETA " in term.frames()[-1]
    snap = drive.progress.snapshot()
    assert (snap.rows_total, snap.rows_estimate, drive.progress.exact_total) == (None, 12_300, None)
    drive.progress.set_total(RowTotal(12_000, estimated=False))
    drive.progress.set_total(RowTotal(99, estimated=True))  # (a late estimate: ignored)
    drive.run(seconds=1, tok_per_s=300, rows_per_s=1)
    assert "| 6 of 12,000 rows, " in term.frames()[-1]
    assert drive.progress.snapshot().rows_total == drive.progress.exact_total == 12_000


def test_an_estimate_the_rows_done_passed_is_no_total(term: FakeTerminal) -> None:
    """Rows done past an estimate: the rows left are unknown (it said "ETA 0 s" and 110%)."""
    from tokenmill.jobs.row_estimate import RowTotal

    drive = Driver(total=None, done=0, stream=term)
    drive.progress.set_total(RowTotal(5, estimated=True))
    drive.run(seconds=8, tok_per_s=300, rows_per_s=1)
    assert term.frames()[-1] == "8 rows, 300 output tok/s, ETA unknown, 8 in flight"
    assert drive.progress.eta_seconds is None


def test_the_bar_never_says_100_percent_with_rows_left(term: FakeTerminal) -> None:
    """tqdm rounds its percentage: 1,995 of 2,000 rows drew " 100%" with 5 rows to run."""
    drive = Driver(total=2000, done=1995, stream=term)
    drive.now += 1.0
    drive.progress.tick()
    assert term.frames()[-1].startswith(" 99%|")
    drive.now += 1.0
    drive.progress.update(5, 50)
    assert term.frames()[-1].startswith("100%|")
