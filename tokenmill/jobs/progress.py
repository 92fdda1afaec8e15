"""Progress: a bar on a terminal, plain periodic log lines otherwise, and the report's samples.

    executor ── after every engine step ──► tick() ───────┐
    runner   ── each finished row ────────► update() ─────┴─► every sample_s: live() ─► rate
                                                              windows, report samples, the bar;
                                                              every interval_s: a log line
    heartbeat thread ── a step spans the line's moment ──► write_overdue(): the last sample's
                                                              line, said to be that old

What it counts is what the engine generates, not only what finished rows hold: ``live()``
gives the output tokens generated so far (rows still generating included) and the rows in
flight, so there is a rate and a line before the first row finishes. The clock starts when
the model has loaded (the runner builds Progress then); model loading that happens later
(Ray replicas load when their first rows arrive; ``LiveCounts.load_seconds``) is taken out
of the rate's window. Rates are over a recent window (rate_window.py):

    output tok/s  tokens generated over the last 30 s
    ETA           the tokens the rows left will take, over the output tok/s: each row not
                  started the mean length, each row in flight the rest of a row that has
                  run as far, both estimated from the finished rows and the rows in flight
                  alike (row_lengths.py: the short rows finish first, so the finished rows
                  alone said too little); "ETA unknown" until some row has finished (and
                  without an input row count)

The input's row total comes when it is known (``set_total``, from any thread): the first
row never waits for it. A local run counts it beside the run; remote JSONL is estimated
from a sample (row_estimate.py), shown as "~12,300 rows" until the reader reaches the end of
the input and the feed gives the exact total. An estimate is never ``exact_total``, so never
the report's ``rows_total``.

A log line reads (with the row count known):

    120 of 2,000 rows done (6%), 256 in flight, 41,280 output tokens so far, 1,650 output
    tok/s, ETA 3 min 05 s

When the stream (stderr) is a terminal, a bar (progress_bar.py) shows the same numbers
instead of the lines, redrawn at every sample:

     6%|██▋          | 120 of 2,000 rows, 1,650 output tok/s, ETA 3 min 05 s, 256 in flight

Each sample also goes to the run's history (``history``, run_history.py: what report.html
plots), with the engines' counters when ``counters`` gives them.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from tokenmill.jobs.bounded_series import BoundedSeries
from tokenmill.jobs.rate_window import RateWindow
from tokenmill.jobs.row_lengths import RowLengths
from tokenmill.jobs.run_history import RunHistory
from tokenmill.jobs.share_done import percent_done

if TYPE_CHECKING:
    from tokenmill.jobs.engine_counters import EngineCounters
    from tokenmill.jobs.progress_bar import ProgressBar
    from tokenmill.jobs.progress_heartbeat import ProgressHeartbeat
    from tokenmill.jobs.row_estimate import RowTotal

__all__ = ["LiveCounts", "Progress", "format_duration"]

log = logging.getLogger("tokenmill.jobs")

TOKENS_WINDOW_S = 30.0
ROWS_WINDOW_S = 120.0  # longer: rows finish in waves when many start together
MAX_REPORT_SAMPLES = 1000  # past this the report keeps every other sample, twice as far apart


@dataclass(frozen=True)
class LiveCounts:
    """What an executor reports while it runs (RowProcessor.live, RayExecutor.live)."""

    output_tokens: int = 0  # generated this run so far, rows still generating included
    rows_in_flight: int = 0  # handed to the engine(s), no result yet
    load_seconds: float = 0.0  # model loading after the progress clock started (Ray replicas)
    # each row in flight's output tokens so far, where the executor knows them (local); else
    # the rows in flight are taken to have an equal share of the tokens in flight
    row_tokens: tuple[int, ...] | None = None
    # rows finished and out of the rows in flight, not handed on yet (so not counted done)
    rows_finishing: int = 0
    # rows the engines put back for want of KV cache this run (each recomputed): shown on
    # the line, as a run that thrashes runs at a fraction of its speed with no other sign
    preemptions: int = 0
    # the engines' context (a row's prompt and output tokens at most), where the executor
    # knows it only once an engine has loaded (a Ray replica): it bounds each completion
    max_model_len: int | None = None


@dataclass(frozen=True)
class ProgressSnapshot:
    """A running job's progress, as its progress line says it (``JobHandle.progress``).
    ``rows_total`` and the rates are None until known; ``rows_estimate`` is the input's
    rows estimated (remote JSONL: row_estimate.py) while ``rows_total`` is not known."""

    rows_done: int  # committed or finished, earlier runs included
    rows_total: int | None  # counted, never estimated
    rows_in_flight: int
    output_tokens: int  # generated this run
    output_tokens_per_s: float | None  # over the recent window
    eta_seconds: float | None
    rows_estimate: int | None = None


class Progress:
    """Counts rows and tokens of one run and shows them. ``total``: the input's rows, counted
    (None if not counted yet: ``set_total`` gives them later, counted or estimated);
    ``already_done``: rows committed by earlier runs. A line is logged every
    ``interval_s`` seconds, or a bar is redrawn at every sample when ``stream`` (default:
    stderr) is a terminal; ``live`` is called at most every ``sample_s`` seconds (default:
    1 s, or ``interval_s`` if shorter), on the caller's thread; rates need a sample's span of
    history. ``history`` (a RunHistory) records every sample for report.html, with each
    replica's engine counters from ``counters`` if given. ``max_tokens``: the output tokens
    a row takes at most by the job's settings, lowered to ``completions`` (a row's) times
    the context once ``live`` gives one. ``clock`` is injectable for tests."""

    def __init__(
        self,
        total: int | None,
        already_done: int,
        enabled: bool = True,
        interval_s: float = 10.0,
        live: Callable[[], LiveCounts] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sample_s: float | None = None,
        stream: TextIO | None = None,
        counters: Callable[[], Mapping[str, EngineCounters]] | None = None,
        max_tokens: int | None = None,
        completions: int = 1,
    ) -> None:
        if interval_s <= 0 or (sample_s is not None and sample_s <= 0):
            raise ValueError(f"interval_s and sample_s must be > 0, got {interval_s}, {sample_s}")
        sample_s = min(1.0, interval_s) if sample_s is None else sample_s
        self.total = total  # shown: counted, or estimated (``total_estimated``)
        self.total_estimated = False  # (set_total's)
        self._total_lock = threading.Lock()  # (set_total comes from the count's thread)
        # the output tokens a row takes at most by the job's settings (max_tokens, within the
        # context, x best_of; OpenAI Batch rows may set their own)
        self.max_tokens = max_tokens
        self._completions = completions
        self.done = already_done
        self.done_this_run = 0
        self.tokens = 0  # output tokens generated this run (the live count when it is larger)
        self.finished_tokens = 0  # of which in finished rows
        self.generated_rows = 0  # rows finished with tokens (not bad rows, nor copies)
        self.ended = False  # the run's stream of results has ended (finish)
        self.ended_at: float | None = None  # the clock at ``finish``: the report's last sample
        self.in_flight = 0
        self.preemptions = 0  # this run's, as the executor last reported them
        self.load_seconds = 0.0
        self._lengths = RowLengths(max_tokens)
        # The output tokens the rows left will take, as of the last sample (RowLengths):
        # worked out there, from the rows finished and in flight at one moment; a finished
        # row's length newer than the rows in flight's counts made rows look to end there.
        self._tokens_left: float | None = None
        # (seconds since the clock started, output tokens) for the report
        self._samples: BoundedSeries[int] = BoundedSeries(sample_s, MAX_REPORT_SAMPLES)
        # the same spacing and bound as ``samples``, so both keep the same moments
        self.history = RunHistory(counters, sample_s, MAX_REPORT_SAMPLES)
        self.enabled = enabled
        self.interval_s = interval_s
        self._live = live
        self._clock = clock
        self._sample_s = sample_s
        # the model loaded: the report's samples and its generation_seconds count from here
        self.start = clock()
        self._last_sample = self._last_log = self._last_tick = self.start
        self._sampled = False  # (no sample yet: the rows in flight are not known)
        # The engine's thread and the heartbeat's write the line: one at a time, and never
        # while a sample is half taken
        self._line_lock = threading.Lock()
        self._heartbeat: ProgressHeartbeat | None = None
        self._token_rate = RateWindow(TOKENS_WINDOW_S, min_span_s=sample_s)
        self._row_rate = RateWindow(ROWS_WINDOW_S, min_span_s=sample_s)
        self._token_rate.add(self.start, 0)
        self._row_rate.add(self.start, 0)
        self._bar: ProgressBar | None = None
        stream = sys.stderr if stream is None else stream
        if enabled and stream.isatty() and _has_width(stream):
            from tokenmill.jobs.progress_bar import ProgressBar

            self._bar = ProgressBar(stream, total, already_done)

    def set_total(self, total: RowTotal | None) -> None:
        """The input's rows, counted or estimated, once known (from any thread: the count
        runs beside the run). An estimate never replaces a counted total; None changes
        nothing. Shown from the next sample on."""
        if total is None:
            return
        with self._total_lock:
            if total.estimated and self.total is not None and not self.total_estimated:
                return
            self.total, self.total_estimated = total.rows, total.estimated

    @property
    def exact_total(self) -> int | None:
        """The input's rows if counted (None while unknown or only estimated): what the
        report may say."""
        with self._total_lock:
            return None if self.total_estimated else self.total

    @property
    def _total_now(self) -> int | None:
        """The total to show and to take the ETA from: an estimate that the rows done have
        passed says nothing any more (the rows left are unknown)."""
        total = self.total
        if total is not None and self.total_estimated and self.done >= total:
            return None
        return total

    @property
    def samples(self) -> list[tuple[float, int]]:
        """(seconds since the clock started, output tokens so far): the report's throughput
        over time, about one a second, fewer than MAX_REPORT_SAMPLES however long the run."""
        return self._samples.points

    def update(self, rows: int, tokens: int) -> None:
        """``rows`` finished (or failed) with ``tokens`` output tokens between them; rows
        without tokens (bad rows, copies of a duplicate's result) took no engine work."""
        self.done += rows
        self.done_this_run += rows
        self.finished_tokens += tokens
        self.tokens = max(self.tokens, self.finished_tokens)
        if tokens > 0:
            self.generated_rows += rows
            self._lengths.add(rows, tokens)
            self.in_flight = max(self.in_flight - rows, 0)  # (until the next live sample)
        self.tick()

    def tick(self) -> None:
        """Take a sample and show progress when they are due; cheap otherwise (the local
        executor calls it after every engine step)."""
        now = self._last_tick = self._clock()
        if now - self._last_sample < self._sample_s:
            return
        with self._line_lock:
            now = self._clock()  # (after the heartbeat's line, if it held the lock)
            self._last_sample = now
            self._sample(now)
            if self._bar is not None:
                self._bar.show(self.done, self.bar_text(), self._total_now)
            elif self.enabled and now - self._last_log >= self.interval_s:
                self._last_log = now
                log.info("%s", self.line())

    def start_heartbeat(self) -> None:
        """Write the log line on time through engine steps longer than a second, from a
        thread of its own (progress_heartbeat.py) until ``finish`` or ``close``; nothing
        without log lines (disabled, or a bar)."""
        if self.enabled and self._bar is None and self._heartbeat is None and not self.ended:
            from tokenmill.jobs.progress_heartbeat import ProgressHeartbeat

            self._heartbeat = ProgressHeartbeat(self, self._sample_s)

    def write_overdue(self) -> None:
        """Log the line if it is due and no tick came for a sample's span (the engine's
        thread is inside a step): the last sample's numbers, said to be that old; before any
        sample, how long the first step has run. The heartbeat's thread calls it."""
        with self._line_lock:
            now = self._clock()
            late = now - self._last_log >= self.interval_s
            if self.ended or not late or now - self._last_tick < self._sample_s:
                return
            self._last_log = now
            if self._sampled:
                age = format_duration(now - self._last_sample)
                log.info("%s (counted %s ago: an engine step is running)", self.line(), age)
            else:
                log.info(
                    "%s done, the engine's first step running for %s (no output token yet: "
                    "on a CPU the first steps take seconds each)",
                    self._rows(), format_duration(now - self.start),
                )  # fmt: skip

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens per second over the recent window; None without a basis yet (less
        than a sample's span, or no token counted at all: a Ray replica not yet heard from)."""
        return self._token_rate.rate() if self.tokens else None

    @property
    def eta_seconds(self) -> float | None:
        """Seconds until every input row is done: the tokens the rows left will take
        (``RowLengths``: each row not started the mean length, each row in flight the rest
        of a row that has run as far) at the recent output tok/s (rows finish in waves, so
        a rate of rows rose and fell between them, and bad rows or copies read at once made
        it absurdly fast); at the recent rows/s while no row has generated tokens, or while
        a row in flight has run past every finished row without a ``max_tokens`` to bound
        it. None without a basis (no row count, nothing finished in the window), or once
        the run has ended with rows left (stopped)."""
        total = self._total_now
        if total is None:
            return None
        remaining = max(total - self.done, 0)
        if remaining == 0:
            return 0.0
        if self.ended or not self.tokens:
            # no engine work yet (Ray replicas loading): the rows done are bad rows and
            # copies, whose rate said "ETA 1 h 04 min" for a run 25 s from its end
            return None
        tok_per_s = self.tokens_per_s
        left = self._tokens_left
        if self.generated_rows and tok_per_s and left is not None:
            return max(left, 1.0) / tok_per_s
        return self._eta_by_rows(remaining)

    def _running_tokens(self, counts: LiveCounts) -> tuple[int, ...]:
        """The rows in flight's output tokens so far: the executor's, or else the tokens in
        flight shared evenly among them (to the token)."""
        if counts.row_tokens is not None:
            return counts.row_tokens
        rows = self.in_flight
        if rows <= 0:
            return ()
        each, extra = divmod(max(self.tokens - self.finished_tokens, 0), rows)
        return (each + 1,) * extra + (each,) * (rows - extra)

    def _eta_by_rows(self, remaining: int) -> float | None:
        """``remaining`` rows at the recent rows/s; None while no row finished in the window."""
        rows_per_s = self._row_rate.rate()
        if not rows_per_s or self._row_rate.increase() <= 0:
            return None
        return remaining / rows_per_s

    def snapshot(self) -> ProgressSnapshot:
        """The numbers of the progress line (read from another thread: each is one read)."""
        with self._total_lock:
            total, estimated = self.total, self.total_estimated
        return ProgressSnapshot(
            self.done, None if estimated else total, self.in_flight, self.tokens,
            self.tokens_per_s, self.eta_seconds, total if estimated else None,
        )  # fmt: skip

    def line(self) -> str:
        """The progress line, as logged."""
        total = self._total_now
        if total:
            rows = f"{self._rows()} done ({percent_done(self.done, total)}%)"
        else:
            rows = f"{self._rows()} done"
        parts = [
            rows,
            f"{self.in_flight:,} in flight",
            f"{self.tokens:,} output tokens so far",
            self._rate("output tok/s not measured yet"),
            self._eta(),
        ]
        if self.preemptions:
            parts.append(
                f"{self.preemptions:,} rows preempted for want of KV cache (recomputed: "
                "raise engine.kv_cache_memory or lower engine.max_num_seqs)"
            )
        return ", ".join(parts)

    def bar_text(self) -> str:
        """The text beside the bar on a terminal: the line's numbers, shorter."""
        parts = [
            self._rows(),
            self._rate("output tok/s: measuring"),
            self._eta(),
            f"{self.in_flight:,} in flight",
        ]
        if self.preemptions:
            parts.append(f"{self.preemptions:,} preempted")
        return ", ".join(parts)

    def _rows(self) -> str:
        total = self._total_now
        if not total:
            return f"{self.done:,} rows"
        return f"{self.done:,} of {'~' if self.total_estimated else ''}{total:,} rows"

    def _rate(self, unmeasured: str) -> str:
        rate = self.tokens_per_s
        return unmeasured if rate is None else f"{rate:,.0f} output tok/s"

    def _eta(self) -> str:
        eta = self.eta_seconds
        return "ETA unknown" if eta is None else f"ETA {format_duration(eta)}"

    def finish(self) -> None:
        """Take a last sample (the run's stream of results has ended), for the report; no
        row is in flight any more, and no ETA is given for rows left (a stopped run), even
        when the sample raises (it reads the executor, which may be what failed)."""
        self._stop_heartbeat()
        now = self._clock()
        self._last_sample = self.ended_at = now
        try:
            self._sample(now, last=True)
        finally:
            self.ended = True
            self.in_flight = 0
        if self._bar is not None:
            self._bar.show(self.done, self.bar_text(), self._total_now)

    def close(self) -> None:
        self._stop_heartbeat()
        if self._bar is not None:
            self._bar.close()

    def _stop_heartbeat(self) -> None:
        # (outside the line's lock: the heartbeat may be waiting for it)
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    def _sample(self, now: float, last: bool = False) -> None:
        self._sampled = True
        if self._live is not None:
            counts = self._live()
            self.tokens = max(self.tokens, counts.output_tokens)
            self.preemptions = max(self.preemptions, counts.preemptions)
            # Rows a step just finished and the runner has not counted yet are still in
            # flight to the reader of the line (a run's last line read "15 of 50 rows done,
            # 0 in flight, ETA 0 s" while 35 rows were being handed on); ``update`` takes
            # each off as it is counted.
            self.in_flight = counts.rows_in_flight + counts.rows_finishing
            if counts.max_model_len is not None:
                self._bound_by_context(counts.max_model_len)
            total = self._total_now
            if total is not None and self.generated_rows:
                running = self._running_tokens(counts)
                queued = max(total - self.done - len(running) - counts.rows_finishing, 0)
                self._tokens_left = self._lengths.tokens_left(queued, running)
            if counts.load_seconds > self.load_seconds:
                self.load_seconds = counts.load_seconds
                # what a replica spent loading is not generation time
                loaded = min(self.start + counts.load_seconds, now)
                self._token_rate.start_at(loaded)
                self._row_rate.start_at(loaded)
        self._token_rate.add(now, self.tokens)
        self._row_rate.add(now, self.done_this_run)
        self._samples.add(now - self.start, self.tokens, last)
        self.history.sample(now - self.start, self.tokens, self.done_this_run, last)

    def _bound_by_context(self, max_model_len: int) -> None:
        """Lower the bound on a row to its completions' context: a Ray run's bound was
        max_tokens (100,000 for "no limit") until then, and a row in flight past every
        finished one was taken to go on to it ("ETA 3 h 25 min" near the end)."""
        within = max_model_len * self._completions
        if self.max_tokens is not None and within < self.max_tokens:
            self.max_tokens = self._lengths.horizon = within


def format_duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 07 min``."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _has_width(stream: TextIO) -> bool:
    """Whether the terminal says how large it is: a pseudo-terminal without a window size
    (some CI runners and containers) reports 0 columns, or its columns set and 0 rows, and
    the bar then showed nothing at all (tqdm draws on no terminal 0 rows high)."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return True  # no size to read: the bar takes its default width
    return size.columns > 0 and size.lines > 0
