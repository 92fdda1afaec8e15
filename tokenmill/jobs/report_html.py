"""report.html: the job report as one self-contained page, beside report.json.

    summary table (report.json's numbers) ─ throughput over time ─ prompt and output lengths
    ─ prefix-cache hit rate ─ per-replica progress ─ speculative acceptance

One file with nothing to fetch (no scripts, stylesheets, fonts or images from elsewhere; the
plots are inline SVG: report_plots.py), so it opens from an object store, a mail attachment
or an air-gapped machine alike. Every number in the summary table is the value report.json
holds, rendered from the same JSON (output tok/s as the end-of-run summary shows it, from the
unrounded rate), and carries it raw in ``data-key``/``data-value`` attributes so that a
script can read the page as well as a person. The time series come from
the run's history (run_history.py); a report without one (a run that generated nothing)
shows the table and says why each plot is missing.
"""

from __future__ import annotations

import html
import importlib
import json
import logging
import re
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from tokenmill.io.storage import OutputStore
from tokenmill.jobs.ownership import REPORT_HTML_NAME
from tokenmill.jobs.report import JobReport, show_seconds
from tokenmill.jobs.run_history import RunHistory

__all__ = ["import_plots_in_background", "page_shows", "render_report_html", "write_report_html"]

log = logging.getLogger("tokenmill.jobs")

_STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:960px;
color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.92em}th,td{padding:.25em .8em;text-align:left}
th{font-weight:600;color:#555}tr:nth-child(even){background:#f6f6f6}
td.num{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:.5em 0}figcaption{font-size:.9em;color:#444}
.row{display:flex;flex-wrap:wrap;gap:1em}.row figure{flex:1 1 360px;min-width:0}
.empty{color:#777;font-style:italic}svg{max-width:100%;height:auto}
"""

# What the page says for a report.json value that is null because it is not known (other
# null values are left out).
_UNKNOWN = {"rows_total": "not counted (the run stopped before it counted them)"}

# (report.json key, label, how to show its value)
_SUMMARY: list[tuple[str, str, Callable[[Any], str]]] = [
    ("status", "status", str),
    ("model", "model", str),
    ("device", "device", str),
    ("executor", "executor", str),
    ("rows_total", "rows in the input", lambda v: f"{v:,}"),
    ("rows_ok", "rows ok", lambda v: f"{v:,}"),
    ("rows_failed", "rows failed (in the error files)", lambda v: f"{v:,}"),
    ("rows_this_run", "rows committed this run", lambda v: f"{v:,}"),
    ("rows_resumed", "rows resumed from earlier runs", lambda v: f"{v:,}"),
    ("rows_not_committed", "rows finished, not kept (a rerun redoes them)", lambda v: f"{v:,}"),
    ("prompt_tokens", "prompt tokens (this run)", lambda v: f"{v:,}"),
    ("completion_tokens", "output tokens (this run)", lambda v: f"{v:,}"),
    ("rows_deduplicated", "rows copied from identical rows (this run)", lambda v: f"{v:,}"),
    (
        "deduplicated_tokens",
        "tokens (prompt and output) those copies did not compute",
        lambda v: f"{v:,}",
    ),
    ("output_tokens_per_s", "output tokens/s (over generation)", lambda v: f"{v:,.1f}"),
    ("generation_seconds", "generation time", show_seconds),
    ("model_load_seconds", "model load time", show_seconds),
    ("wall_seconds", "whole run", show_seconds),
    ("prefix_cache_hit_rate", "prefix-cache hit rate", lambda v: f"{v:.1%}"),
    ("preemptions", "rows preempted for want of KV cache (this run)", lambda v: f"{v:,}"),
    ("shards_committed", "shards committed this run", lambda v: f"{v:,}"),
    ("shards_recomputed", "shards recomputed (files gone)", lambda v: f"{v:,}"),
    ("output", "output", str),
    ("error", "error", str),
]


def import_plots_in_background() -> threading.Thread:
    """Import matplotlib (report_plots.py) on a daemon thread, so that a run's end does not
    wait for it: the runner calls this before the model loads, whose time hides it (0.6 s
    of a 1.0 s report.html on an H200 host, session 19). A failed import is left for
    ``write_report_html`` to report, as it would be without this. Returns the thread."""

    def run() -> None:
        try:
            importlib.import_module("tokenmill.jobs.report_plots")
        except Exception as exc:  # matplotlib missing or broken: the report says so later
            log.debug("report plots not imported ahead: %s: %s", type(exc).__name__, exc)

    thread = threading.Thread(target=run, name="tokenmill-report-import", daemon=True)
    thread.start()
    return thread


def write_report_html(
    store: OutputStore,
    report: JobReport,
    history: RunHistory | None,
    without_plots: str | None = None,
) -> None:
    """Write report.html under ``store`` (atomically, as report.json). A page that cannot be
    drawn (matplotlib missing or failing) is a warning, not a failed job: the rows are
    committed and report.json has every number. A failing store raises, as for report.json.
    ``without_plots``, where given, says why the page has no plots (none are drawn)."""
    try:
        page = render_report_html(report, history, without_plots)
    except Exception as exc:
        hint = " (pip install matplotlib)" if isinstance(exc, ImportError) else ""
        log.warning(
            "report.html not written (%s: %s)%s; report.json has the numbers",
            type(exc).__name__,
            exc,
            hint,
        )
        return
    store.write_atomic(REPORT_HTML_NAME, page.encode())


def page_shows(page: bytes | None, report: JobReport) -> bool:
    """Whether ``page`` (report.html's bytes; None: missing) is ``report``'s page: every
    number its summary table carries (``data-key`` / ``data-value``: report.json's values,
    wall_seconds to the millisecond among them, so another run's page differs) is
    ``report``'s. Values, not the table's text: a newer version's labels or formats (or a
    key it adds, absent from an older page) do not make a rerun of a complete job redraw
    the page without its run's history plots. Needs no matplotlib: checking is cheap."""
    if page is None:
        return False
    shown = _table_values(page.decode("utf-8", errors="replace"))
    ours = _table_values(_summary_table(report))
    return "wall_seconds" in shown and all(ours.get(k) == v for k, v in shown.items())


_TABLE_VALUE = re.compile(r'data-key="([^"]*)" data-value="([^"]*)"')


def _table_values(text: str) -> dict[str, str]:
    """The summary table's ``data-key``: ``data-value`` pairs (the JSON text of each)."""
    return {key: html.unescape(value) for key, value in _TABLE_VALUE.findall(text)}


def render_report_html(
    report: JobReport, history: RunHistory | None = None, without_plots: str | None = None
) -> str:
    """The page for ``report`` with the plots of ``history``, or, where ``without_plots``
    says why, the summary table alone (matplotlib is then neither imported nor used: a
    second stop signal's report has no time for it). Raises ImportError without matplotlib
    (imported here, not with the module: only a finished run draws plots)."""
    title = f"tokenmill job {report.job}: {report.status}"
    if without_plots is not None:
        sections = [f'<p class="empty">{_e(without_plots)}</p>']
    else:
        from tokenmill.jobs import report_plots as plots

        sections = [
            _throughput(plots, report),
            _lengths(plots, report),
            _prefix_cache(plots, report, history),
            _replicas(plots, report, history),
            _speculative(plots, report, history),
        ]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        _summary_table(report),
        *sections,
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _summary_table(report: JobReport) -> str:
    """report.json's numbers as a table, each carried raw in data-value."""
    raw = json.loads(report.to_json())
    # The rate shown is the summary's, from the report's unrounded one: report.json's, rounded
    # to 2 decimals, rounded again to 1 here read 47.9 beside the summary's 47.8.
    shown = {"output_tokens_per_s": report.output_tokens_per_s}
    rows = []
    for key, label, show in _SUMMARY:
        value = raw.get(key)
        if (value is None and key not in _UNKNOWN) or value == "":
            continue
        cls = ' class="num"' if isinstance(value, (int, float)) else ""
        text = _UNKNOWN[key] if value is None else show(shown.get(key, value))
        if key == "output_tokens_per_s" and not report.completion_tokens:
            text = "none generated this run"  # (not "0.0 output tokens/s")
        rows.append(
            f'<tr><th>{_e(label)}</th><td{cls} data-key="{key}" '
            f'data-value="{_e(json.dumps(value))}">{_e(text)}</td></tr>'
        )
    failures = raw.get("replica_failures")
    if failures is not None:
        text = (
            f"{failures['replicas']:,} replicas replaced; {failures['rows_rerun']:,} rows ran "
            f"again, {failures['rows_isolated']:,} isolated into the error file"
        )
        rows.append(
            f'<tr><th>Ray replica failures</th><td data-key="replica_failures" '
            f'data-value="{_e(json.dumps(failures))}">{_e(text)}</td></tr>'
        )
    spec = raw.get("speculative")
    if spec:
        text = (
            f"{spec['method']}: {spec['accepted_tokens']:,} of {spec['draft_tokens']:,} drafts "
            f"accepted ({spec['acceptance_rate']:.1%})"
        )
        rows.append(
            f'<tr><th>speculative decoding</th><td data-key="speculative" '
            f'data-value="{_e(json.dumps(spec))}">{_e(text)}</td></tr>'
        )
    return '<h2>Summary</h2><table class="summary">' + "".join(rows) + "</table>"


def _throughput(plots: ModuleType, report: JobReport) -> str:
    svg = plots.throughput_plot(report.throughput_over_time, report.output_tokens_per_s)
    return _section(
        "Throughput over time",
        svg,
        "output tokens generated per second between samples (rows still generating included)",
        _too_short(report),
    )


def _lengths(plots: ModuleType, report: JobReport) -> str:
    figures = []
    for what, hist in (("prompt", report.prompt_lengths), ("output", report.output_lengths)):
        if not hist or not hist["rows"]:
            continue
        w, start = hist["bin_width"], hist["start"]
        bins = [(start + i * w, start + (i + 1) * w, c) for i, c in enumerate(hist["counts"])]
        svg = plots.length_histogram_plot(bins, what)
        caption = (
            f"{what}: {hist['rows']:,} rows, mean {hist['mean']:,} tokens, "
            f"min {hist['min']:,}, max {hist['max']:,} (bins of {w})"
        )
        figures.append(f"<figure>{svg}<figcaption>{_e(caption)}</figcaption></figure>")
    body = (
        f'<div class="row">{"".join(figures)}</div>'
        if figures
        else '<p class="empty">no row finished with a completion this run</p>'
    )
    return "<h2>Prompt and output lengths</h2>" + body


def _prefix_cache(plots: ModuleType, report: JobReport, history: RunHistory | None) -> str:
    svg, empty = None, _too_short(report)
    if history is not None and history.points:
        t = [s for s, _ in history.points]
        q = [p.counters.prefix_queried_tokens for _, p in history.points]
        h = [p.counters.prefix_hit_tokens for _, p in history.points]
        svg = plots.hit_rate_plot(t, q, h, "prompt tokens found cached (%)")
        if not q[-1]:
            empty = "no prompt token was looked up (engine.enable_prefix_caching is off?)"
    return _section(
        f"Prefix-cache hit rate: {report.prefix_cache_hit_rate:.1%}",
        svg,
        "share of the prompt tokens looked up that the prefix cache already held",
        empty,
    )


def _replicas(plots: ModuleType, report: JobReport, history: RunHistory | None) -> str:
    if history is None or not history.replicas or not history.points:
        return _section("Per-replica progress", None, "", "no replica reported this run")
    t = [s for s, _ in history.points]
    # Each replica by its id, in the ids' order: numbered in the order first heard from,
    # "replica 1" was replica-1 and "replica 2" replica-0. A point taken before a replica
    # was first heard from has no entry for it yet: 0.
    order = sorted(range(len(history.replicas)), key=lambda i: _id_order(history.replicas[i]))
    series = {
        history.replicas[i]: [
            p.replica_tokens[i] if i < len(p.replica_tokens) else 0 for _, p in history.points
        ]
        for i in order
    }
    svg = plots.replica_progress_plot(t, series)
    caption = "output tokens each replica generated"
    rows = []
    for replica in series:
        c = history.last_counters[replica]
        rows.append(
            f"<tr><th>{_e(replica)}</th>"
            f'<td class="num">{c.output_tokens:,}</td>'
            f'<td class="num">{c.prefix_cache_hit_rate:.1%}</td>'
            f'<td class="num">{c.accepted_tokens:,} of {c.draft_tokens:,}</td></tr>'
        )
    table = (
        "<table><tr><th>replica</th><th>output tokens</th>"
        "<th>prefix-cache hit rate</th><th>drafts accepted</th></tr>" + "".join(rows) + "</table>"
    )
    return _section("Per-replica progress", svg, caption, _too_short(report)) + table


def _speculative(plots: ModuleType, report: JobReport, history: RunHistory | None) -> str:
    spec = report.speculative
    if not spec:
        return (
            '<h2>Speculative decoding</h2><p class="empty">off for this job '
            "(engine.speculative.method)</p>"
        )
    svg = None
    if history is not None and history.points:
        t = [s for s, _ in history.points]
        d = [p.counters.draft_tokens for _, p in history.points]
        a = [p.counters.accepted_tokens for _, p in history.points]
        svg = plots.hit_rate_plot(t, d, a, "drafts accepted (%)")
    title = (
        f"Speculative decoding ({spec['method']}): {spec['acceptance_rate']:.1%} of drafts "
        f"accepted, {spec['mean_accepted_per_drafted_row']} a drafted row and step"
    )
    empty = _too_short(report) if spec["draft_tokens"] else "no drafts were made this run"
    return _section(title, svg, "share of the draft tokens the model accepted", empty)


def _too_short(report: JobReport) -> str:
    """Why a plot over time is missing: a run that generated nothing (every row bad, or
    stopped before a token) has none to draw; one that did was too short to sample."""
    if not report.completion_tokens:
        return "no output tokens generated this run"
    return (
        f"no plot: {show_seconds(report.generation_seconds)} of generation gave fewer than "
        "two samples (about one a second); the run's totals are in the summary"
    )


def _section(title: str, svg: str | None, caption: str, empty: str) -> str:
    if svg is None:
        return f'<h2>{_e(title)}</h2><p class="empty">{_e(empty)}</p>'
    note = f"<figcaption>{_e(caption)}</figcaption>" if caption else ""
    return f"<h2>{_e(title)}</h2><figure>{svg}{note}</figure>"


def _id_order(replica: str) -> list[int | str]:
    """A replica id's place among the others: its numbers as numbers, so that replica-2
    comes before replica-10 and replica-0 before its restart replica-0.restart-1."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", replica)]


def _e(text: str) -> str:
    return html.escape(text, quote=True)
