"""The plots of report.html, each drawn with matplotlib and returned as inline SVG text.

Each function takes plain numbers (no JobReport, no RunHistory) and returns ``<svg ...>``
markup, or None when there is nothing to draw. SVG rather than PNG: it stays sharp at any
zoom, is searchable, and is a few kB. Text stays text (``svg.fonttype: none``) so the file
carries no font outlines, and each figure's ids (matplotlib numbers its groups ``axes_1``...
in every figure alike) get a prefix of their own, so several SVGs in one page never share
one. No pyplot: figures are built directly (no global state, no GUI
backend), so this runs on headless machines and beside other threads.
"""

from __future__ import annotations

import io
import itertools
import re
from collections.abc import Sequence

from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = [
    "hit_rate_plot",
    "length_histogram_plot",
    "replica_progress_plot",
    "throughput_plot",
    "time_axis",
]

_FIGURES = itertools.count()
_WIDE = (7.5, 2.8)  # inches at 100 dpi: 750 x 280 px
BLUE, ORANGE, GREY = "#1f77b4", "#ff7f0e", "#7f7f7f"


def time_axis(seconds: Sequence[float]) -> tuple[list[float], str]:
    """``seconds`` in the unit that suits the run's length, and the unit's label."""
    span = max(seconds, default=0.0)
    if span >= 3 * 3600:
        return [s / 3600 for s in seconds], "hours since the model loaded"
    if span >= 600:
        return [s / 60 for s in seconds], "minutes since the model loaded"
    return list(seconds), "seconds since the model loaded"


def throughput_plot(samples: Sequence[tuple[float, int]], mean_rate: float) -> str | None:
    """Output tok/s between consecutive ``samples`` ((seconds, output tokens so far)), with
    the run's overall rate as a dashed line. None with fewer than two samples."""
    if len(samples) < 2:
        return None
    times, rates = [], []
    for (t0, c0), (t1, c1) in zip(samples, samples[1:], strict=False):
        if t1 > t0:
            times.append(t1)
            rates.append((c1 - c0) / (t1 - t0))
    if not times:
        return None
    x, label = time_axis([samples[0][0], *times])
    fig, ax = _figure()
    ax.step(x, [rates[0], *rates], where="pre", color=BLUE, label="output tok/s (per sample)")
    if mean_rate > 0:
        ax.axhline(mean_rate, color=ORANGE, linestyle="--", label=f"run: {mean_rate:,.0f} tok/s")
    ax.set_xlabel(label)
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)
    return _svg(fig)


def length_histogram_plot(bins: Sequence[tuple[int, int, int]], what: str) -> str | None:
    """A bar per bin ((first length, end, rows)); ``what`` names the lengths ("prompt")."""
    if not bins or not any(c for _, _, c in bins):
        return None
    fig, ax = _figure((3.7, 2.8))
    lefts = [lo for lo, _, _ in bins]
    widths = [hi - lo for lo, hi, _ in bins]
    ax.bar(lefts, [c for _, _, c in bins], width=widths, align="edge", color=BLUE, alpha=0.85)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # lengths are whole tokens
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"{what} tokens")
    ax.set_ylabel("rows")
    return _svg(fig)


def hit_rate_plot(
    seconds: Sequence[float], queried: Sequence[int], hits: Sequence[int], what: str
) -> str | None:
    """A rate over time from cumulative counts (prefix-cache hits of tokens queried, drafts
    accepted of drafted): per sample (solid) and since the start (dashed), in percent.
    ``what`` labels the y axis. None with fewer than two samples or nothing ever queried."""
    if len(seconds) < 2 or not queried or queried[-1] <= 0:
        return None
    x, label = time_axis(seconds)
    per_sample: list[float | None] = []
    prev_q, prev_h = 0, 0
    for q, h in zip(queried, hits, strict=True):
        per_sample.append(100 * (h - prev_h) / (q - prev_q) if q > prev_q else None)
        prev_q, prev_h = q, h
    overall = [100 * h / q if q else None for q, h in zip(queried, hits, strict=True)]
    fig, ax = _figure()
    ax.plot(x, _nan(per_sample), color=BLUE, marker=".", markersize=3, label="per sample")
    ax.plot(x, _nan(overall), color=ORANGE, linestyle="--", label="since the start")
    ax.set_xlabel(label)
    ax.set_ylabel(what)
    ax.set_ylim(0, 100)
    ax.legend(loc="lower right", fontsize=8)
    return _svg(fig)


def replica_progress_plot(
    seconds: Sequence[float], tokens_by_replica: dict[str, Sequence[int]]
) -> str | None:
    """Output tokens each replica generated so far, one line per replica; None with fewer
    than two samples."""
    if len(seconds) < 2 or not tokens_by_replica:
        return None
    x, label = time_axis(seconds)
    fig, ax = _figure()
    for name, tokens in tokens_by_replica.items():
        ax.plot(x, tokens, label=name)
    ax.set_xlabel(label)
    ax.set_ylabel("output tokens so far")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    return _svg(fig)


def _figure(size: tuple[float, float] = _WIDE) -> tuple[Figure, Axes]:
    fig = Figure(figsize=size, dpi=100, layout="constrained")
    ax = fig.subplots()
    ax.grid(True, color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    return fig, ax


def _nan(values: Sequence[float | None]) -> list[float]:
    return [float("nan") if v is None else v for v in values]


def _svg(fig: Figure) -> str:
    """The figure as SVG markup to inline in HTML (no XML declaration or doctype)."""
    buf = io.StringIO()
    with rc_context({"svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return _scope_ids(text[text.index("<svg") :], f"f{next(_FIGURES)}-")


def _scope_ids(svg: str, prefix: str) -> str:
    """``svg`` with ``prefix`` before each of its ids and before every reference to one
    (``href="#id"``, ``url(#id)``)."""
    ids = set(re.findall(r'\bid="([^"]+)"', svg))
    svg = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}{m[1]}"', svg)
    return re.sub(
        r'(href="#|url\(#)([^")]+)',
        lambda m: m[1] + prefix + m[2] if m[2] in ids else m[0],
        svg,
    )
