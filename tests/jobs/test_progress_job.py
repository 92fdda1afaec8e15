"""What a user sees of a run on the tiny model: loading lines, live progress, the summary, and a
rerun of a finished job."""

from __future__ import annotations

import gc
import json
import logging
import re
import time
from pathlib import Path

import pytest
import yaml

from tests.jobs.job_helpers import chat_rows, job_dict, write_jsonl
from tokenmill import run_job
from tokenmill.io.rows import InputRow
from tokenmill.jobs.cli import main as cli_main
from tokenmill.jobs.local_executor import RowProcessor
from tokenmill.jobs.progress import Progress
from tokenmill.jobs.row_source import FeedItem
from tokenmill.jobs.spec import JobSpec

# Long rows (each generates all its max_tokens), so a row takes many engine steps.
LONG = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
PROGRESS = re.compile(
    r"^(\d+) of (\d+) rows done \(\d+%\), (\d+) in flight, ([\d,]+) output tokens so far, "
    r"(?:([\d,]+) output tok/s|output tok/s not measured yet), (ETA .+)$"
)


def test_counts_tokens_of_rows_still_generating(tiny_model: Path, tmp_path: Path) -> None:
    spec = JobSpec.from_dict(job_dict(tiny_model, tmp_path, tmp_path, sampling=LONG))
    processor = RowProcessor(spec)
    rows = [InputRow(i, f"r{i}", f"gen:{i}", prompt=f"count to {i}") for i in range(6)]
    seen = []
    frozen: list[int] = []  # the engine loop runs with the collector's heap frozen

    def on_step() -> None:
        seen.append(processor.live())
        if not frozen:  # once: get_freeze_count walks every frozen object
            frozen.append(gc.get_freeze_count())

    try:
        results = []
        for result in processor.process(rows, on_step=on_step):
            if not results:
                before_first = list(seen)
            results.append(result)
        counters = processor.counters
    finally:
        processor.close()
    # before any row finished: rows in flight and their tokens, growing step by step; at
    # the step that finished them, all six finishing (out of flight, not handed on yet)
    assert before_first[-2].rows_in_flight == 6 and before_first[-2].output_tokens >= 6 * 250
    assert (before_first[-1].rows_in_flight, before_first[-1].rows_finishing) == (0, 6)
    # and each row's own count, for the ETA (row_lengths.py), while all six generate
    middle = before_first[len(before_first) // 2]
    assert middle.row_tokens is not None and len(middle.row_tokens) == 6
    assert sum(middle.row_tokens) == middle.output_tokens and min(middle.row_tokens) >= 100
    tokens = [c.output_tokens for c in seen]
    assert tokens == sorted(tokens) and tokens[0] > 0
    assert counters.output_tokens == sum(r.completion_tokens for r in results) == 6 * 300
    assert frozen[0] > 0 and gc.get_freeze_count() == 0  # and unfrozen once it ended


def test_the_live_count_has_the_tokens_of_rows_that_finished_in_the_step(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The step that finishes requests takes their tokens out of the engine's count: the
    live count stood still for that step's sample and jumped at the next (a 0-then-spike
    rate at the end of report.html's plot). The rows it finished are out of flight at that
    sample and counted as finishing until each is handed on: no row is counted nowhere (a
    row neither done nor in flight looked queued, and the ETA waited for it to start)."""
    spec = JobSpec.from_dict(job_dict(tiny_model, tmp_path, tmp_path, sampling=LONG))
    processor = RowProcessor(spec)
    rows = [InputRow(i, f"r{i}", f"gen:{i}", prompt="the same prompt") for i in range(4)]
    lives = []
    finishing: list[int] = []
    try:
        for _ in processor.process(rows, on_step=lambda: lives.append(processor.live())):
            finishing.append(processor.live().rows_finishing)
    finally:
        processor.close()
    seen = [live.output_tokens for live in lives]
    assert len(finishing) == 4 and seen[-1] == 4 * 300  # all four finish in the last step
    last = lives[-1]
    assert (last.rows_in_flight, last.row_tokens, last.rows_finishing) == (0, (), 4)
    assert lives[-2].rows_in_flight == 4 and lives[-2].rows_finishing == 0
    assert finishing == [3, 2, 1, 0]  # as each is handed on
    steps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    assert all(step <= 4 for step in steps), steps  # one token a row a step, no jump


def test_log_shows_loading_and_a_live_rate_then_a_rerun_has_nothing_to_do(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(12))
    out = tmp_path / "out"
    spec = job_dict(tiny_model, src, out, sampling=LONG)
    caplog.set_level(logging.INFO)
    report = run_job(spec, progress_interval_s=0.05)
    assert report.status == "complete" and report.rows_ok == 12

    messages = [r.getMessage() for r in caplog.records]
    loading = messages.index(f"loading model {tiny_model} ...")
    loaded = next(i for i, m in enumerate(messages) if re.match(r"model loaded in \d+\.\d s$", m))
    lines = [PROGRESS.match(m) for m in messages[loaded:]]
    lines = [m for m in lines if m is not None]
    assert loading < loaded and lines
    # a line before the first row finished (engine.max_num_seqs 8 of 12 rows at a time)
    first = lines[0]
    assert first[1] == "0" and first[2] == "12" and int(first[3]) > 0
    assert int(first[4].replace(",", "")) > 0 and first[6] == "ETA unknown"
    # a rate above zero before the end (the rate needs one sample's span)
    assert any(m[5] is not None and int(m[5].replace(",", "")) > 0 for m in lines)
    assert any(m[6] != "ETA unknown" for m in lines)

    raw = json.loads((out / "report.json").read_text())
    assert raw["completion_tokens"] == 12 * 300
    assert 0 < raw["generation_seconds"] < raw["wall_seconds"]
    assert raw["model_load_seconds"] > 0
    assert raw["output_tokens_per_s"] == pytest.approx(
        raw["completion_tokens"] / raw["generation_seconds"], rel=1e-3
    )
    assert raw["throughput_over_time"][-1][1] == 12 * 300
    assert "of generation (model load" in report.summary()

    # a rerun: nothing to load, a clear line, no rate over no time; report.json kept
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    caplog.clear()
    capsys.readouterr()
    assert cli_main([str(job)]) == 0
    printed = capsys.readouterr().out
    expected = f"nothing to do: all 12 rows already committed (output: {out})"
    assert expected in printed and expected in caplog.text
    assert "tokens/s" not in printed and "over 0.0 s" not in printed
    assert "loading model" not in caplog.text
    assert json.loads((out / "report.json").read_text()) == raw


class _SlowSource:
    """A RowSource whose rows come late: ``empty`` waits give nothing (a resume's reader
    skipping committed shards), then one row, then the end."""

    def __init__(self, processor: RowProcessor, empty: int) -> None:
        self.processor = processor
        self.empty = empty
        self.exhausted = False

    def take(self, max_rows: int, wait: bool) -> list[FeedItem]:
        if self.empty:
            self.empty -= 1
            return []
        self.exhausted = True
        return self.processor.prepare([InputRow(0, "r0", "gen:0", prompt="late")])


def test_progress_is_due_while_the_engine_waits_for_rows(tiny_model: Path, tmp_path: Path) -> None:
    """While no row reaches the engine (a resume whose reader skips a long job's committed
    shards: 4.4 s for 199,950 rows here, minutes on a larger one), ``on_step`` still runs
    at every wait, so the progress line keeps coming; it ran after engine steps only, and
    a resume logged nothing until its first new row ran."""
    spec = JobSpec.from_dict(job_dict(tiny_model, tmp_path, tmp_path, sampling={"max_tokens": 1}))
    processor = RowProcessor(spec)
    steps: list[int] = []
    try:
        source = _SlowSource(processor, empty=5)
        results = list(processor.process(source, on_step=lambda: steps.append(source.empty)))
    finally:
        processor.close()
    assert len(results) == 1
    assert steps[:5] == [4, 3, 2, 1, 0]  # one at each wait, before the first row ran


def test_generation_seconds_and_the_plots_samples_count_from_the_same_instant(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """generation_seconds started once the input feed was set up, the plot's samples (the
    progress clock) as the model loaded: on a loaded box the plot's last point was at 5.61 s
    against 4.92 s of generation, and tok/s read 14% high. A slow feed set-up between the two
    instants now counts in both."""
    from tokenmill.jobs import runner

    class SlowFeed(runner.RowFeed):  # the reader thread's start on a loaded box
        def __init__(self, *args: object, **kwargs: object) -> None:
            time.sleep(0.5)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(runner, "RowFeed", SlowFeed)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(6))
    report = run_job(job_dict(tiny_model, src, tmp_path / "out"), show_progress=False)
    assert report.status == "complete" and report.generation_seconds > 0.5
    last_point = report.throughput_over_time[-1][0]  # (rounded to 10 ms)
    assert report.generation_seconds == pytest.approx(last_point, abs=0.006)


def test_the_eta_bounds_a_row_by_the_context_where_max_tokens_is_past_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A ``max_tokens`` past the context (100,000 with a 64-token max_model_len: "no limit")
    was the ETA's bound on a row: a row in flight longer than every finished row was taken
    to go on to 100,000 tokens, and a 3-row run 10 s from its end read "ETA 3 h 25 min". A
    row's prompt and output fit the context, so no row left takes more than that."""
    context = 64
    rows = [{"id": f"r{i}", "prompt": "x" * (4 + 3 * i)} for i in range(12)]  # 4..37 tokens
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    spec = job_dict(
        tiny_model,
        src,
        tmp_path / "out",
        input={"prompt_column": "prompt", "messages_column": None, "passthrough_columns": []},
        sampling={"max_tokens": 100_000, "temperature": 0.0, "ignore_eos": True},
        engine={"max_model_len": context},
    )
    etas: list[tuple[float, int]] = []  # (the tokens the ETA counts on, rows left)

    def watch(progress: Progress) -> None:
        lengths = progress._lengths
        tokens_left = lengths.tokens_left

        def counted(queued: int, running: tuple[int, ...]) -> float:
            # what the ETA divides by the rate, beside the rows it is for (read together:
            # the product of the ETA and a rate sampled apart drifted with timing)
            left = tokens_left(queued, running)
            etas.append((left, queued + len(running)))
            return left

        lengths.tokens_left = counted  # type: ignore[method-assign]

    report = run_job(spec, progress_interval_s=0.05, on_progress=watch)  # (a sample a step)
    assert report.status == "complete" and report.rows_ok == 12
    assert etas, "no ETA while the rows generated"
    assert all(tokens <= left * context for tokens, left in etas), max(etas)


def test_a_line_comes_on_time_while_the_first_engine_step_runs(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch
) -> None:
    """On a CPU the first steps take seconds each (8 and 21 s on a loaded 2-core box), and
    the line, written between steps, came 30 s after the model loaded where README says a
    line every 10 s; it now comes on time, saying the first step is running."""
    from tokenmill.engine.llm_engine import LLMEngine

    step = LLMEngine.step
    first_ended: list[float] = []

    def slow_first_step(self: LLMEngine) -> object:
        if not first_ended:
            time.sleep(1.0)
            first_ended.append(time.time())
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", slow_first_step)
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(4))
    caplog.set_level(logging.INFO)
    report = run_job(job_dict(tiny_model, src, tmp_path / "out"), progress_interval_s=0.3)
    assert report.status == "complete"
    during = [r.getMessage() for r in caplog.records if r.created < first_ended[0]]
    assert any("the engine's first step running for" in m for m in during), during
