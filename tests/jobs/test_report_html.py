"""report.html: the run's history in bounded memory, the page's plots and numbers, a real job's
page read back with html.parser (well-formed, self-contained, the same numbers as report.json),
and the page on object storage (fsspec's memory filesystem: the object-store code path)."""

from __future__ import annotations

import json
import logging
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from tests.jobs.job_helpers import chat_rows, job_dict, write_jsonl
from tokenmill import run_job
from tokenmill.io.rows import ResultRow
from tokenmill.io.storage import OutputStore
from tokenmill.jobs import report_html
from tokenmill.jobs.engine_counters import EngineCounters
from tokenmill.jobs.length_histogram import LengthHistogram
from tokenmill.jobs.ownership import OutputOwnedError, check_claimable
from tokenmill.jobs.report import JobReport
from tokenmill.jobs.report_html import render_report_html, write_report_html
from tokenmill.jobs.run_history import RunHistory
from tokenmill.jobs.shard_commit import discard_progress

_VOID = {"meta", "br", "img", "input", "link", "hr", "area", "base", "col", "source", "wbr"}
_REFERENCES = ("src", "href", "xlink:href", "srcset", "action", "poster", "data")


class PageCheck(HTMLParser):
    """Reads a page: unbalanced tags, references, ids and the summary's data-key values."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.problems: list[str] = []
        self.tags: Counter[str] = Counter()
        self.references: list[tuple[str, str, str]] = []
        self.ids: list[str] = []
        self.values: dict[str, Any] = {}
        self.feed(page)
        self.close()
        if self.stack:
            self.problems.append(f"never closed: {self.stack}")

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._element(tag, attrs)
        if tag not in _VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._element(tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def _element(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] += 1
        found = dict(attrs)
        self.references += [(tag, k, found[k] or "") for k in _REFERENCES if k in found]
        if found.get("id"):
            self.ids.append(found["id"] or "")
        if "data-key" in found:
            self.values[found["data-key"] or ""] = json.loads(found["data-value"] or "null")


def _check_self_contained(page: str) -> PageCheck:
    """Well-formed, nothing fetched from elsewhere, every inline SVG valid XML; returns the
    parse."""
    check = PageCheck(page)
    assert not check.problems, check.problems
    assert page.startswith("<!DOCTYPE html>")
    assert not {"script", "link", "iframe", "object", "embed"} & set(check.tags)
    outside = [r for r in check.references if not r[2].startswith(("#", "data:"))]
    assert not outside, outside  # only fragments within the page (SVG markers, clip paths)
    assert all(u.startswith("#") for u in re.findall(r"url\(\s*['\"]?([^)'\"]*)", page))
    assert "@import" not in page
    duplicated = [i for i, n in Counter(check.ids).items() if n > 1]
    assert not duplicated, duplicated  # several SVGs in one page must not share ids
    for svg in re.findall(r"<svg\b.*?</svg>", page, flags=re.S):
        ET.fromstring(svg)  # raises on malformed SVG
    return check


def test_length_histogram_stays_exact_as_its_bins_widen() -> None:
    hist = LengthHistogram(num_bins=8)
    lengths = [0, 3, 3, 7, 8, 15, 16, 40, 41, 63, 5]
    for n in lengths:
        hist.add(n)
    assert hist.bin_width == 8 and len(hist.counts) == 8  # 63 needed 8 bins of 8
    for lo, hi, count in hist.bins():
        assert count == sum(lo <= n < hi for n in lengths)
    raw = hist.to_dict()
    assert raw["rows"] == len(lengths) and raw["tokens"] == sum(lengths)
    assert (raw["min"], raw["max"], raw["start"], raw["counts"]) == (
        0,
        63,
        0,
        [5, 2, 1, 0, 0, 2, 0, 1],
    )
    with pytest.raises(ValueError, match="length"):
        hist.add(-1)


def test_run_history_is_bounded_and_follows_replicas_as_they_appear() -> None:
    counts: dict[str, EngineCounters] = {}
    history = RunHistory(lambda: counts, sample_s=1.0, max_points=100)
    for t in range(1, 1001):
        counts["a"] = EngineCounters(
            prefix_queried_tokens=10 * t, prefix_hit_tokens=5 * t, output_tokens=7 * t
        )
        if t >= 300:  # a replica that loaded late
            counts["b"] = EngineCounters(output_tokens=3 * (t - 299))
        history.sample(float(t), 10 * t, t // 10)
    history.sample(1000.5, 10_005, 100, last=True)
    points = history.points
    assert len(points) < 100 and points[-1][0] == 1000.5
    assert history.replicas == ["a", "b"]
    t_early, early = next((t, p) for t, p in points if t < 300)
    assert early.replica_tokens == (7 * int(t_early),)  # "b" not heard from yet
    _, last = points[-1]
    assert last.replica_tokens == (7000, 3 * 701)
    assert last.counters.prefix_hit_tokens == 5000 and last.counters.output_tokens == 7000 + 2103
    for row in (
        ResultRow(0, "r0", prompt_tokens=12, completion_tokens=4),
        ResultRow(1, "r1", error="in.jsonl:2: bad"),
    ):
        history.add_result(row)
    assert history.prompt_lengths.count == 1 and history.output_lengths.total == 4


def _synthetic_run() -> tuple[JobReport, RunHistory]:
    """A 2-replica run with speculative decoding, 60 s of samples."""
    counts: dict[str, EngineCounters] = {}
    history = RunHistory(lambda: counts)
    for t in range(0, 61):
        counts["actor-1"] = EngineCounters(100 * t, 60 * t, 40 * t, 16 * t, 10 * t, 500 * t)
        if t >= 5:
            counts["actor-2"] = EngineCounters(100 * t, 70 * t, 40 * t, 20 * t, 10 * t, 450 * t)
        history.sample(float(t), 950 * t, 2 * t, last=t == 60)
    for i in range(120):
        history.add_result(ResultRow(i, f"r{i}", prompt_tokens=100 + i, completion_tokens=i % 50))
    report = JobReport(
        job="demo",
        output="s3://bucket/out",
        status="complete",
        rows_total=120,
        rows_ok=120,
        rows_this_run=120,
        prompt_tokens=history.prompt_lengths.total,
        completion_tokens=history.output_lengths.total,
        wall_seconds=75.0,
        model_load_seconds=12.5,
        generation_seconds=60.0,
        prefix_cache_hit_rate=0.65,
        executor="ray",
        model="smollm2-135m-instruct",
        device="ray: 2 replicas",
        speculative=(sum(counts.values(), EngineCounters())).speculative("suffix"),
        replica_failures={"replicas": 3, "rows_rerun": 40, "rows_isolated": 1},
        throughput_over_time=[(float(t), 950 * t) for t in range(61)],
        prompt_lengths=history.prompt_lengths.to_dict(),
        output_lengths=history.output_lengths.to_dict(),
    )
    return report, history


def test_a_page_with_every_plot() -> None:
    report, history = _synthetic_run()
    page = render_report_html(report, history)
    check = _check_self_contained(page)
    # throughput, 2 length histograms, prefix cache, replicas, speculative acceptance
    assert check.tags["svg"] == 6
    assert check.values == {
        k: v for k, v in json.loads(report.to_json()).items() if k in check.values
    }
    assert check.values["speculative"]["acceptance_rate"] == report.speculative["acceptance_rate"]
    assert {"model", "device", "rows_ok", "output_tokens_per_s", "wall_seconds"} <= set(
        check.values
    )
    assert "<th>actor-1</th>" in page and "<th>actor-2</th>" in page
    assert "Speculative decoding (suffix): 45.0% of drafts accepted" in page
    assert check.values["replica_failures"] == report.replica_failures
    assert "3 replicas replaced; 40 rows ran again, 1 isolated" in page
    assert "3 failed and were replaced; 40 rows they held ran again" in report.summary()


def test_every_count_of_report_json_is_on_the_page() -> None:
    """rows_not_committed (a cancel's) and deduplicated_tokens were in report.json and the
    summary, not on the page."""
    report = JobReport(
        job="j", output="out", status="cancelled", rows_not_committed=304,
        rows_deduplicated=240, deduplicated_tokens=12_440,
    )  # fmt: skip
    check = _check_self_contained(render_report_html(report, None))
    counts = {k for k, v in json.loads(report.to_json()).items() if isinstance(v, int)}
    assert counts <= set(check.values), counts - set(check.values)
    assert check.values["rows_not_committed"] == 304
    assert check.values["deduplicated_tokens"] == 12_440


def test_a_short_generation_is_not_shown_as_0_s_beside_its_rate() -> None:
    """An audit: report.html gave "generation time 0.0 s" beside 800 output tokens/s (the
    summary said 0.015 s)."""
    report = JobReport(
        job="j", output="out", status="complete", completion_tokens=12, rows_this_run=6,
        generation_seconds=0.015, model_load_seconds=0.06, wall_seconds=1234.5,
    )  # fmt: skip
    page = render_report_html(report, None)
    assert "0.015 s" in page and "0.06 s" in page and "1,234.5 s" in page
    assert "0.0 s" not in page and "0.015 s of generation" in report.summary()


def test_the_pages_output_rate_is_the_summarys() -> None:
    """report.json rounds the rate to 2 decimals and the page rounded that to 1: 240 tokens
    over 5.016 s (47.846 tok/s) read 47.8 in the summary, 47.9 on the page."""
    report = JobReport(
        job="j", output="out", status="complete", completion_tokens=240, rows_this_run=30,
        generation_seconds=5.016,
    )  # fmt: skip
    page = render_report_html(report, None)
    shown = re.search(r'data-key="output_tokens_per_s"[^>]*>([^<]*)<', page)
    assert shown is not None and shown[1] == "47.8"
    assert "47.8 output tokens/s over 5.0 s of generation" in report.summary()
    assert _check_self_contained(page).values["output_tokens_per_s"] == 47.85  # report.json's
    # drawn again from report.json (a found-complete run's repair): the same
    again = JobReport.from_json(report.to_json())
    assert report_html.page_shows(page.encode(), again)


def test_replicas_are_named_by_their_ids_in_the_ids_order() -> None:
    """The page numbered replicas in the order first heard from: "replica 1" was the
    replica with id replica-1 and "replica 2" replica-0."""
    counts: dict[str, EngineCounters] = {}
    history = RunHistory(lambda: counts)
    for t in range(5):
        counts["replica-1"] = EngineCounters(output_tokens=100 * t)
        if t >= 2:
            counts["replica-0"] = EngineCounters(output_tokens=50 * t)
        if t >= 3:
            counts["replica-10"] = EngineCounters(output_tokens=10 * t)
            counts["replica-0.restart-1"] = EngineCounters(output_tokens=5 * t)
        history.sample(float(t), 165 * t, t, last=t == 4)
    report = JobReport(
        job="j", output="out", status="complete", executor="ray", completion_tokens=660,
        generation_seconds=4.0, throughput_over_time=[(float(t), 165 * t) for t in range(5)],
    )  # fmt: skip
    page = render_report_html(report, history)
    rows = re.findall(r'<tr><th>([^<]*)</th><td class="num">([\d,]+)</td>', page)
    assert rows == [("replica-0", "200"), ("replica-0.restart-1", "20"), ("replica-1", "400"),
                    ("replica-10", "40")]  # fmt: skip
    assert "replica 1" not in page and "replica 2" not in page
    legend = re.findall(r"<text[^>]*>([^<]*replica[^<]*)</text>", page)  # (SVG text)
    assert legend == ["replica-0", "replica-0.restart-1", "replica-1", "replica-10"], legend


def test_a_page_without_samples_says_why() -> None:
    report = JobReport(job="j", output="out", status="cancelled", wall_seconds=1.0)
    page = render_report_html(report, None)
    check = _check_self_contained(page)
    assert check.tags["svg"] == 0
    assert "no output tokens generated this run" in page and "off for this job" in page


def test_a_run_that_generated_nothing_says_so_not_too_short_or_0_per_s() -> None:
    """An audit: a run whose every row was bad (0.066 s of "generation") read "no plot:
    0.066 s of generation gave fewer than two samples" and "0.0" output tokens/s."""
    report = JobReport(
        job="j", output="out", status="complete", rows_failed=30, generation_seconds=0.066,
    )  # fmt: skip
    page = render_report_html(report, None)
    check = _check_self_contained(page)
    assert "fewer than two samples" not in page
    shown = re.search(r'data-key="output_tokens_per_s"[^>]*>([^<]*)<', page)
    assert shown is not None and shown[1] == "none generated this run"
    assert check.values["output_tokens_per_s"] == 0.0  # report.json's value kept
    assert report_html.page_shows(page.encode(), JobReport.from_json(report.to_json()))


def test_the_page_goes_to_object_storage_through_the_output_store() -> None:
    store = OutputStore("memory://tokenmill-report-test/out", owner="demo")
    assert not store.is_local
    report, history = _synthetic_run()
    write_report_html(store, report, history)
    page = store.read_bytes("report.html").decode()
    assert _check_self_contained(page).tags["svg"] == 6
    store.delete("report.html")


def test_a_page_that_cannot_be_drawn_is_a_warning_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(report: JobReport, history: RunHistory | None, *why: str | None) -> str:
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(report_html, "render_report_html", broken)
    store = OutputStore(str(tmp_path), owner="j")
    write_report_html(store, JobReport(job="j", output=str(tmp_path)), None)
    assert not (tmp_path / "report.html").exists()
    assert "report.html not written (ImportError" in caplog.text and "matplotlib" in caplog.text


def test_a_page_without_plots_draws_none_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second stop signal's page (runner's ``_last_report``) has no time for matplotlib:
    the summary table alone, and the reason in place of the plots."""
    report, history = _synthetic_run()
    monkeypatch.setitem(sys.modules, "tokenmill.jobs.report_plots", None)  # import fails
    page = render_report_html(report, history, "no plots: stopped at once")
    assert "<svg" not in page and "no plots: stopped at once" in page
    assert report_html.page_shows(page.encode(), report)


def test_a_page_is_checked_against_report_json_without_drawing() -> None:
    """report.json read back gives the page's summary again (what a found-complete run
    checks report.html against); another run's numbers, or no page, do not match."""
    report, history = _synthetic_run()
    report.status = "complete"
    page = render_report_html(report, history).encode()
    saved = JobReport.from_json(report.to_json())
    assert saved.to_json() == report.to_json()
    assert report_html.page_shows(page, saved)
    saved.wall_seconds += 0.001  # another run of the same job
    assert not report_html.page_shows(page, saved)
    assert not report_html.page_shows(None, report)
    with pytest.raises(TypeError):
        JobReport.from_json('{"status": "complete"}')  # no job: not a report


def test_report_html_belongs_to_the_job(tmp_path: Path) -> None:
    """A folder holding someone else's report.html is not claimed; --fresh removes the job's."""
    (tmp_path / "report.html").write_text("<p>not ours</p>")
    store = OutputStore(str(tmp_path), owner="j")
    with pytest.raises(OutputOwnedError, match="report.html"):
        check_claimable(store, "j")
    discard_progress(store, "j")
    assert not (tmp_path / "report.html").exists()


def test_a_job_writes_report_html_beside_report_json(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", chat_rows(12))
    out = tmp_path / "out"
    sampling = {"max_tokens": 48, "ignore_eos": True}
    caplog.set_level(logging.WARNING, "tokenmill.jobs")  # no progress line every 0.02 s
    # samples every 0.02 s, so that even a fast machine's run has a series to plot
    report = run_job(job_dict(tiny_model, src, out, sampling=sampling), progress_interval_s=0.02)
    assert report.status == "complete"
    raw = json.loads((out / "report.json").read_text())
    page = (out / "report.html").read_text()
    check = _check_self_contained(page)
    # every summary number is report.json's; the JSON's own keys are all there
    assert check.values == {k: raw[k] for k in check.values}
    expected = {
        "status",
        "model",
        "device",
        "rows_total",
        "rows_ok",
        "rows_failed",
        "prompt_tokens",
        "completion_tokens",
        "output_tokens_per_s",
        "generation_seconds",
        "model_load_seconds",
        "wall_seconds",
        "prefix_cache_hit_rate",
    }
    assert expected <= set(check.values)
    assert raw["model"] == str(tiny_model) and raw["device"] == "cpu"
    assert raw["rows_ok"] == 12 and raw["completion_tokens"] == 12 * 48
    # the histograms count this run's rows and tokens, and the page shows them
    prompt, output = raw["prompt_lengths"], raw["output_lengths"]
    assert sum(prompt["counts"]) == prompt["rows"] == 12 == output["rows"]
    assert prompt["tokens"] == raw["prompt_tokens"] and output["tokens"] == 12 * 48
    assert output["min"] == output["max"] == 48
    assert f"prompt: 12 rows, mean {prompt['mean']:,} tokens" in page
    # throughput, two histograms, prefix-cache hit rate, the one local replica
    assert check.tags["svg"] == 5, re.findall(r'class="empty">([^<]*)', page)
    assert f"Prefix-cache hit rate: {raw['prefix_cache_hit_rate']:.1%}" in page
    assert "<th>local</th>" in page and "off for this job" in page


def test_plots_are_imported_on_a_daemon_thread_and_a_failure_is_left_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    imported: list[str] = []

    def failing_import(name: str) -> None:
        imported.append(name)
        raise ImportError("no matplotlib here")

    monkeypatch.setattr(report_html.importlib, "import_module", failing_import)
    thread = report_html.import_plots_in_background()
    assert thread.daemon
    thread.join(10)
    assert imported == ["tokenmill.jobs.report_plots"]  # and the thread ended without raising


def test_a_page_is_checked_by_its_values_not_its_wording() -> None:
    """A rerun of a complete job checks report.html against report.json: compared as
    text, a newer version's labels (or its new keys) made an older, right page read as
    another run's, and it was drawn again without the run's history plots."""
    report, history = _synthetic_run()
    report.status = "complete"
    page = render_report_html(report, history)
    assert "<svg" in page
    older = page.replace("whole run", "run time").replace('data-key="preemptions"', "")
    saved = JobReport.from_json(report.to_json())
    assert report_html.page_shows(older.encode(), saved)
    saved.wall_seconds += 0.001  # another run of the same job
    assert not report_html.page_shows(older.encode(), saved)
    assert not report_html.page_shows(b"<p>no table</p>", report)
