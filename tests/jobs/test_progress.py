"""Progress and the report's times, driven by a fake clock and injected live counts."""

from __future__ import annotations

import json
import logging
import time

import pytest

from tokenmill.jobs.progress import MAX_REPORT_SAMPLES, LiveCounts, Progress, format_duration
from tokenmill.jobs.rate_window import RateWindow
from tokenmill.jobs.report import JobReport


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """What an executor's ``live`` reports, set by the test."""

    def __init__(self) -> None:
        self.counts = LiveCounts()

    def __call__(self) -> LiveCounts:
        return self.counts


def _progress(
    total: int | None = 100, done: int = 0, interval_s: float = 10.0
) -> tuple[Progress, FakeClock, FakeEngine]:
    clock, engine = FakeClock(), FakeEngine()
    progress = Progress(total, done, interval_s=interval_s, live=engine, clock=clock)
    return progress, clock, engine


def _run(
    progress: Progress,
    clock: FakeClock,
    engine: FakeEngine,
    seconds: int,
    tok_per_s: int,
    rows_per_s: float = 0.0,
    in_flight: int = 8,
) -> None:
    """``seconds`` of generation at a steady rate, ticking every second as the executor does
    after its steps (rows finish as whole numbers once their share adds up)."""
    owed = 0.0
    for _ in range(seconds):
        clock.now += 1.0
        tokens = engine.counts.output_tokens + tok_per_s
        load, preempted = engine.counts.load_seconds, engine.counts.preemptions
        engine.counts = LiveCounts(tokens, in_flight, load, preemptions=preempted)
        owed += rows_per_s
        if owed >= 1:
            progress.update(int(owed), 0)  # the rows' tokens are already in the live count
            owed -= int(owed)
        else:
            progress.tick()


def test_rate_window_keeps_the_last_window_and_its_baseline() -> None:
    w = RateWindow(window_s=10, min_span_s=1)
    assert w.rate() is None
    w.add(0, 0)
    w.add(0.5, 50)
    assert w.rate() is None  # less than a second of history
    for t in range(1, 31):
        w.add(t, 100 * t if t <= 20 else 2000 + 10 * (t - 20))
    assert w.rate() == pytest.approx(10.0)  # the last 10 s only: the fast start is gone
    assert w.increase() == pytest.approx(100)
    with pytest.raises(ValueError, match="time order"):
        w.add(29, 0)


def test_rate_window_start_at_drops_the_time_before() -> None:
    w = RateWindow(window_s=60)
    w.add(0, 0)
    w.add(10, 0)  # loading: nothing generated
    w.add(25, 500)  # the first results, generated since t=20
    w.start_at(20)
    assert w.rate() == pytest.approx(100.0)  # 500 tokens over 5 s, not 25 s


def test_a_line_and_a_rate_before_any_row_finishes(caplog: pytest.LogCaptureFixture) -> None:
    progress, clock, engine = _progress(total=50, interval_s=10)
    caplog.set_level(logging.INFO, "tokenmill.jobs")
    _run(progress, clock, engine, seconds=9, tok_per_s=120, in_flight=16)
    assert not caplog.records  # every 10 s
    _run(progress, clock, engine, seconds=1, tok_per_s=120, in_flight=16)
    (record,) = caplog.records
    assert record.getMessage() == (
        "0 of 50 rows done (0%), 16 in flight, 1,200 output tokens so far, "
        "120 output tok/s, ETA unknown"
    )


def test_a_line_is_written_on_time_while_an_engine_step_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The line was written between engine steps only: on a CPU the first steps took 8 and
    21 s, and the first line came 30 s after the model loaded (README: every 10 s). The
    heartbeat's ``write_overdue`` writes it on time from the last sample, and only then: not
    while ticks come (the engine thread writes it), nor before it is due, nor twice."""
    progress, clock, engine = _progress(total=50, interval_s=10)
    caplog.set_level(logging.INFO, "tokenmill.jobs")
    clock.now += 10.0  # the first step, still running
    progress.write_overdue()
    (first,) = caplog.records
    assert first.getMessage() == (
        "0 of 50 rows done, the engine's first step running for 10 s (no output token yet: "
        "on a CPU the first steps take seconds each)"
    )
    clock.now += 9.0
    progress.write_overdue()  # not due again yet
    engine.counts = LiveCounts(16, 16)
    progress.tick()  # the first step ends (its sample), and the second starts
    clock.now += 3.0
    progress.write_overdue()
    assert len(caplog.records) == 2
    assert caplog.records[1].getMessage() == (
        "0 of 50 rows done (0%), 16 in flight, 16 output tokens so far, 1 output tok/s, "
        "ETA unknown (counted 3 s ago: an engine step is running)"
    )
    # steps shorter than a sample: the engine's thread writes the line, not the heartbeat
    _run(progress, clock, engine, seconds=10, tok_per_s=10, in_flight=16)
    progress.write_overdue()
    assert len(caplog.records) == 3 and "counted" not in caplog.records[2].getMessage()
    progress.finish()
    clock.now += 60.0
    progress.write_overdue()
    assert len(caplog.records) == 3


def test_the_heartbeat_writes_the_line_through_a_long_step_and_stops_at_finish(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The heartbeat thread itself: a line while no tick comes, none once finished."""
    caplog.set_level(logging.INFO, "tokenmill.jobs")
    progress = Progress(50, 0, interval_s=0.05, live=FakeEngine())
    progress.start_heartbeat()
    deadline = time.monotonic() + 5.0
    while not caplog.records and time.monotonic() < deadline:
        time.sleep(0.01)  # the engine's thread inside a long step: no tick
    progress.finish()
    written = len(caplog.records)
    assert written and "first step running for" in caplog.records[0].getMessage()
    time.sleep(0.2)
    assert len(caplog.records) == written


def test_the_rate_counts_generated_tokens_not_finished_rows() -> None:
    """The issue's demo: rows finish late, and all at once; the rate must not wait for them."""
    progress, clock, engine = _progress(total=40)
    _run(progress, clock, engine, seconds=20, tok_per_s=11)
    assert progress.tokens_per_s == pytest.approx(11.0)
    assert progress.eta_seconds is None  # no row finished: no basis
    clock.now += 1
    engine.counts = LiveCounts(engine.counts.output_tokens + 11, 0)
    progress.update(20, 20 * 8)  # 20 rows finish together, holding fewer tokens than generated
    assert progress.tokens == 21 * 11  # the live count, never the smaller finished one
    assert progress.tokens_per_s == pytest.approx(11.0)


def test_the_rate_is_smoothed_over_a_recent_window() -> None:
    progress, clock, engine = _progress(total=None)
    _run(progress, clock, engine, seconds=5, tok_per_s=0)  # a long first prefill
    _run(progress, clock, engine, seconds=60, tok_per_s=1000)
    assert progress.tokens_per_s == pytest.approx(1000.0)  # the slow start has left the window
    _run(progress, clock, engine, seconds=30, tok_per_s=400)
    assert progress.tokens_per_s == pytest.approx(400.0)
    assert progress.eta_seconds is None  # no row count: no ETA


def test_eta_from_rows_remaining_and_the_recent_rows_per_second() -> None:
    progress, clock, engine = _progress(total=1000, done=400)  # 400 committed by earlier runs
    _run(progress, clock, engine, seconds=200, tok_per_s=100, rows_per_s=0.5)
    _run(progress, clock, engine, seconds=120, tok_per_s=100, rows_per_s=2)
    assert progress.done == 400 + 100 + 240
    # 260 rows left at the last 120 s's 2 rows/s (not the run's average)
    assert progress.eta_seconds == pytest.approx(130.0)
    assert "ETA 2 min 10 s" in progress.line()


def test_eta_follows_the_tokens_rows_take_not_the_waves_they_finish_in() -> None:
    """Rows of equal length finish in waves (a batch at a time): the rows/s between waves fell
    and the ETA rose while the time left shrank (25 s, then 40 s, with 19 then 14 s left).
    100 rows of 100 tokens, 10 at a time, at 100 tok/s: a wave every 10 s."""
    progress, clock, engine = _progress(total=100)
    etas = []
    for second in range(1, 51):
        clock.now += 1.0
        engine.counts = LiveCounts(100 * second, 10)
        if second % 10 == 0:
            progress.update(10, 1000)
        else:
            progress.tick()
        if second > 10:
            etas.append(progress.eta_seconds)
    truth = [100 - s for s in range(11, 51)]
    assert etas == pytest.approx(truth, abs=1.0)  # the time left, wave or no wave
    progress.finish()
    assert progress.eta_seconds is None and progress.in_flight == 0  # stopped: no ETA


@pytest.mark.parametrize("max_tokens", [64, None, 32])
def test_eta_while_the_short_rows_finished_first_is_not_zero(max_tokens: int | None) -> None:
    """50 rows start at once; after 6 s the 12 shortest (30 tokens) are done and the 38 in
    flight have 40 tokens each: the tokens a finished row took said nothing was left ("ETA
    0 s" with 38 rows running). They are taken to run to max_tokens (64: 24 tokens more
    each); without it, or past it (32: rows with their own max_tokens), the rows/s says
    38 / (12 / 6 s) = 19 s."""
    clock, engine = FakeClock(), FakeEngine()
    progress = Progress(50, 0, live=engine, clock=clock, max_tokens=max_tokens)
    for second in range(1, 6):
        clock.now += 1.0
        engine.counts = LiveCounts(50 * 7 * second, 50)
        progress.tick()
    clock.now += 1.0
    engine.counts = LiveCounts(12 * 30 + 38 * 40, 38)
    progress.update(12, 12 * 30)
    if max_tokens is None or max_tokens < 40:
        assert progress.eta_seconds == pytest.approx(19.0)
    else:
        assert progress.eta_seconds == pytest.approx(38 * 24 / progress.tokens_per_s)


@pytest.mark.parametrize("completions", [1, 2])
def test_a_context_known_only_once_an_engine_loaded_bounds_the_rows_eta(
    completions: int,
) -> None:
    """A Ray run's replicas load their engines after the run's Progress is built, so its
    bound on a row was max_tokens (100,000: "no limit") whatever the context: the 38 rows
    in flight, past every finished row, were taken to go on to 100,000 tokens each. Once
    the live counts give the context (64 tokens a completion), no row takes more."""
    clock, engine = FakeClock(), FakeEngine()
    progress = Progress(
        50, 0, live=engine, clock=clock, max_tokens=100_000 * completions,
        completions=completions,
    )  # fmt: skip
    for second in range(1, 6):  # the replicas loading: no context yet
        clock.now += 1.0
        engine.counts = LiveCounts(50 * 7 * second, 50)
        progress.tick()
    assert progress.max_tokens == 100_000 * completions
    clock.now += 1.0
    engine.counts = LiveCounts(12 * 30 + 38 * 40, 38, max_model_len=64 // completions)
    progress.update(12, 12 * 30)
    assert progress.max_tokens == 64
    assert progress.eta_seconds == pytest.approx(38 * 24 / progress.tokens_per_s)


def test_bad_rows_and_copies_do_not_speed_up_the_eta() -> None:
    """100 bad rows (no engine work) counted at once made the first ETA 2 s, with 100 s left."""
    progress, clock, engine = _progress(total=300)
    progress.update(100, 0)  # 100 bad rows read at once
    for second in range(1, 11):
        clock.now += 1.0
        engine.counts = LiveCounts(100 * second, 10)
        if second % 5 == 0:
            progress.update(5, 250)  # rows of 50 tokens
        else:
            progress.tick()
    # 190 rows left at 50 tokens (9,500), less the 500 the rows in flight have generated,
    # at 100 tok/s
    assert progress.eta_seconds == pytest.approx(90.0)


def test_no_eta_from_bad_rows_alone_while_the_engines_load() -> None:
    """Ray replicas load for 10 s after the clock starts, the reader meanwhile finding 52 bad
    rows: their rate said "ETA 1 h 04 min" for a run 25 s from its end (an audit). No token
    generated yet: no basis for an ETA."""
    progress, clock, engine = _progress(total=20_000)
    for _ in range(10):
        clock.now += 1.0
        engine.counts = LiveCounts(0, 512)
        progress.update(5, 0)  # bad rows: no engine work
    assert progress.eta_seconds is None
    assert progress.line().endswith("output tok/s not measured yet, ETA unknown")


def test_a_live_count_that_dips_never_lowers_the_tokens() -> None:
    progress, clock, engine = _progress()
    _run(progress, clock, engine, seconds=3, tok_per_s=100)
    clock.now += 1
    engine.counts = LiveCounts(250, 8)  # a finished row left the engine before its result came
    progress.tick()
    assert progress.tokens == 300


def test_model_loading_after_the_clock_started_is_not_generation_time() -> None:
    """A Ray replica loads its model when its first rows arrive: 20 s of nothing, then its
    first chunk with 500 tokens generated in 5 s."""
    progress, clock, engine = _progress(total=100)
    _run(progress, clock, engine, seconds=24, tok_per_s=0, in_flight=32)
    assert progress.tokens_per_s is None  # nothing heard yet: no rate, rather than 0
    assert "32 in flight, 0 output tokens so far, output tok/s not measured yet" in progress.line()
    clock.now += 1
    engine.counts = LiveCounts(500, 24, load_seconds=20.0)
    progress.update(8, 500)
    assert progress.load_seconds == 20.0
    assert progress.tokens_per_s == pytest.approx(100.0)
    assert progress.eta_seconds == pytest.approx(92 / (8 / 5))


def test_no_live_counts_falls_back_to_finished_rows(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    progress = Progress(4, 0, interval_s=2, clock=clock)
    caplog.set_level(logging.INFO, "tokenmill.jobs")
    for _ in range(4):
        clock.now += 1
        progress.update(1, 10)
    assert progress.tokens == 40 and progress.tokens_per_s == pytest.approx(10.0)
    assert [r.getMessage().split(",")[0] for r in caplog.records] == [
        "2 of 4 rows done (50%)",
        "4 of 4 rows done (100%)",
    ]
    assert progress.eta_seconds == 0.0


def test_disabled_progress_logs_nothing_but_keeps_samples(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, engine = FakeClock(), FakeEngine()
    progress = Progress(10, 0, enabled=False, live=engine, clock=clock)
    caplog.set_level(logging.INFO, "tokenmill.jobs")
    _run(progress, clock, engine, seconds=30, tok_per_s=5)
    assert not caplog.records
    assert progress.samples[0] == (1.0, 5) and progress.samples[-1] == (30.0, 150)


def test_report_samples_stay_bounded() -> None:
    progress, clock, engine = _progress(total=None, interval_s=1e9)
    _run(progress, clock, engine, seconds=3 * MAX_REPORT_SAMPLES, tok_per_s=1)
    assert len(progress.samples) < MAX_REPORT_SAMPLES
    times = [t for t, _ in progress.samples]
    assert times == sorted(times) and times[-1] >= 2 * MAX_REPORT_SAMPLES


def test_bad_intervals_are_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        Progress(1, 0, interval_s=0)


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 42.4, 185, 3600 * 2 + 7 * 60 + 30)] == [
        "0 s",
        "42 s",
        "3 min 05 s",
        "2 h 07 min",
    ]


def _complete(rows: int, **fields: float) -> JobReport:
    """The report of a complete run of ``rows`` rows, all this run's."""
    return JobReport(
        job="j", output="out/", status="complete", rows_total=rows, rows_ok=rows,
        rows_this_run=rows, **fields,
    )  # fmt: skip


def test_summary_throughput_is_over_generation_time() -> None:
    report = _complete(
        10,
        completion_tokens=1000,
        wall_seconds=65.0,
        model_load_seconds=50.0,
        generation_seconds=10.0,
    )
    assert report.output_tokens_per_s == 100.0
    assert (
        "throughput  100.0 output tokens/s over 10.0 s of generation "
        "(model load 50.0 s, whole run 65.0 s)"
    ) in report.summary()
    raw = json.loads(report.to_json())
    assert raw["output_tokens_per_s"] == 100.0 and raw["generation_seconds"] == 10.0


def test_a_sub_second_generation_time_is_not_shown_as_zero() -> None:
    """A tiny job once read "2000.0 output tokens/s over 0.0 s of generation"."""
    report = _complete(
        3, completion_tokens=24, generation_seconds=0.012, wall_seconds=0.4,
        model_load_seconds=0.03,
    )  # fmt: skip
    assert (
        "2000.0 output tokens/s over 0.012 s of generation (model load 0.03 s, whole run 0.4 s)"
    ) in report.summary()


def test_summary_without_tokens_shows_no_rate() -> None:
    report = JobReport(job="j", output="out/", status="cancelled", wall_seconds=3.0)
    summary = report.summary()
    assert "no output tokens generated this run" in summary
    assert "tokens/s" not in summary and "over 0.0 s" not in summary


def test_a_stopped_runs_summary_says_how_many_rows_are_left() -> None:
    """A cancelled 30-row job said "12 ok, 0 failed" and never how many rows were left."""
    report = JobReport(job="j", output="out/", status="cancelled", rows_total=30, rows_ok=11)
    report.rows_failed = 1
    assert "  left        18 of the input's 30 rows: a rerun resumes with them" in (
        report.summary().splitlines()
    )
    done = JobReport(job="j", output="out/", status="complete", rows_total=30, rows_ok=30)
    uncounted = JobReport(job="j", output="out/", status="cancelled", rows_ok=3)
    assert "left" not in done.summary() and "left" not in uncounted.summary()


def test_a_summarys_counts_of_one_read_in_the_singular() -> None:
    """A cancelled run with one of each said "1 rows finished ... computes them again",
    "1 times a row was put back", "1 failed and were replaced", "1 committed shards"."""
    report = JobReport(
        job="j", output="out/", status="cancelled", rows_total=1, rows_not_committed=1,
        preemptions=1, rows_deduplicated=1, deduplicated_tokens=1, shards_recomputed=1,
        replica_failures={"replicas": 1, "rows_rerun": 1, "rows_isolated": 0},
    )  # fmt: skip
    lines = report.summary().splitlines()
    for line in (
        "  not kept    1 row finished in shards not complete at the stop: a rerun computes it "
        "again",
        "  left        1 of the input's 1 row: a rerun resumes with it",
        "  dedup       1 row copied from identical rows (1 token not computed, this run)",
        "  replicas    1 failed and was replaced; 1 row they held ran again, 0 isolated (error "
        "file)",
        "  recomputed  1 committed shard whose files were gone or changed",
    ):
        assert line in lines
    assert any(line.startswith("  preempted   1 time a row was put back ") for line in lines)


def test_a_resumed_runs_summary_says_whose_hit_rate_and_copies_it_gives() -> None:
    """The rows line covers the whole job, earlier runs included; the prefix-hit and dedup
    lines below it, this run's alone, did not say so and read as the job's."""
    report = JobReport(
        job="j", output="out/", status="complete", rows_total=40, rows_ok=40, rows_this_run=20,
        rows_resumed=20, completion_tokens=160, generation_seconds=2.0,
        prefix_cache_hit_rate=0.342, rows_deduplicated=6, deduplicated_tokens=300,
    )  # fmt: skip
    lines = report.summary().splitlines()
    assert "  prefix cache hit rate 34.2% (this run)" in lines
    assert (
        "  dedup       6 rows copied from identical rows (300 tokens not computed, this run)"
        in (lines)
    )


def test_summary_of_a_job_with_nothing_to_do() -> None:
    report = JobReport(job="j", output="out/", status="complete", rows_total=5, rows_ok=4)
    report.rows_failed = 1
    summary = report.summary()
    assert summary.splitlines()[0] == (
        "job j: complete; nothing to do: all 5 rows already committed (output: out/)"
    )
    assert "tok" not in summary and "0.0 s" not in summary
    empty = JobReport(job="j", output="out/", status="complete", rows_total=0)
    assert "the input has no rows" in empty.summary()
    uncounted = JobReport(job="j", output="out/", status="complete")  # rows_total None
    assert "nothing to do: every row already committed" in uncounted.summary()


def test_finish_takes_a_last_sample_for_the_report() -> None:
    progress, clock, engine = _progress()
    _run(progress, clock, engine, seconds=3, tok_per_s=10)
    clock.now += 0.25
    progress.update(2, 45)
    progress.finish()
    assert progress.samples[-2:] == [(3.0, 30), (3.25, 45)]


def test_finish_ends_the_progress_even_when_its_last_sample_fails() -> None:
    """A failed run's executor may be what fails the last sample: the Progress still ends,
    with no row in flight and no ETA, and the sample's error goes to the caller."""
    clock, alive = FakeClock(), [True]

    def live() -> LiveCounts:
        if not alive[0]:
            raise RuntimeError("replica died")
        return LiveCounts(50, 4)

    progress = Progress(10, 0, live=live, clock=clock, sample_s=1.0)
    clock.now += 1.0
    progress.tick()
    assert progress.in_flight == 4
    alive[0] = False
    with pytest.raises(RuntimeError, match="replica died"):
        progress.finish()
    assert progress.ended and progress.in_flight == 0 and progress.eta_seconds is None


def test_rows_a_step_finished_are_in_flight_until_counted(caplog: pytest.LogCaptureFixture) -> None:
    """The local executor samples right after a step, before it hands that step's finished
    rows on: they are no longer in the engine and not counted done yet. The quickstart's last
    line read "15 of 50 rows done (30%), 0 in flight ... ETA 0 s" with 35 rows so placed."""
    progress, clock, engine = _progress(total=50, interval_s=1)
    caplog.set_level(logging.INFO, "tokenmill.jobs")
    progress.update(15, 700)
    clock.now += 1.0
    engine.counts = LiveCounts(2577, 0, rows_finishing=35)
    progress.tick()
    assert "15 of 50 rows done (30%), 35 in flight" in caplog.records[-1].getMessage()
    assert progress.snapshot().rows_in_flight == 35
    progress.update(35, 1877)  # counted: done, and out of flight
    assert (progress.done, progress.in_flight) == (50, 0)


def test_counting_the_rows_holds_one_line_at_a_time(tmp_path) -> None:
    """The count read 65,536 lines into a list: a file of long documents whole in memory
    (900 MB of 0.5 MB rows: 1.5 GB RSS) for the progress bar's total."""
    import tracemalloc

    from tokenmill.io.readers import InputConfig
    from tokenmill.jobs.row_count import RowTotal, input_row_total

    f = tmp_path / "long.jsonl"
    row = json.dumps({"prompt": "x" * 200_000}).encode() + b"\n"
    f.write_bytes(row * 200 + b"\n  \n" + row)  # 40 MB; two blank lines
    tracemalloc.start()
    try:
        assert input_row_total(InputConfig(path=str(f))) == RowTotal(201, estimated=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20, peak  # a few lines and the reader's buffers, not the file


def test_an_estimated_total_reads_as_one_in_the_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """Without a terminal, the log line shows an estimate with "~" (README's example)."""
    from tokenmill.jobs.row_estimate import RowTotal

    caplog.set_level(logging.INFO, "tokenmill.jobs")
    now = [0.0]
    progress = Progress(None, 0, interval_s=1.0, clock=lambda: now[0])
    progress.set_total(RowTotal(2_000, estimated=True))
    now[0] += 1.0
    progress.update(120, 0)
    assert caplog.records[-1].getMessage().startswith("120 of ~2,000 rows done (6%), ")


def test_the_line_never_says_100_percent_with_rows_left(caplog: pytest.LogCaptureFixture) -> None:
    """1,995 of 2,000 rows read "(100%)", rounded, with 5 rows still to run: the share is
    the rows done, rounded down, so 100% means every row is done."""
    clock = FakeClock()
    progress = Progress(2000, 1994, interval_s=1, clock=clock)
    caplog.set_level(logging.INFO, "tokenmill.jobs")
    clock.now += 1
    progress.update(1, 10)
    assert caplog.records[-1].getMessage().startswith("1,995 of 2,000 rows done (99%), ")
    for _ in range(5):
        clock.now += 1
        progress.update(1, 10)
    assert caplog.records[-1].getMessage().startswith("2,000 of 2,000 rows done (100%), ")


def test_the_line_says_when_rows_are_preempted(caplog: pytest.LogCaptureFixture) -> None:
    """A run thrashing for want of KV cache (rows preempted and recomputed) showed nothing
    on its line until its summary: the line now says how many, and what to change."""
    progress, clock, engine = _progress(total=50, interval_s=10)
    caplog.set_level(logging.INFO, "tokenmill.jobs")
    _run(progress, clock, engine, seconds=10, tok_per_s=120, in_flight=16)
    assert "preempted" not in caplog.records[-1].getMessage()
    engine.counts = LiveCounts(engine.counts.output_tokens, 16, preemptions=37)
    _run(progress, clock, engine, seconds=10, tok_per_s=120, in_flight=16)
    line = caplog.records[-1].getMessage()
    assert "16 in flight" in line and line.endswith(
        ", 37 rows preempted for want of KV cache (recomputed: raise "
        "engine.kv_cache_memory or lower engine.max_num_seqs)"
    )
    assert progress.bar_text().endswith(", 16 in flight, 37 preempted")
