"""ProgressBar: the terminal rendering of a job's progress (tqdm), and nothing else.

     6%|██▋          | 120 of 2,000 rows, 1,650 output tok/s, ETA 3 min 05 s, 256 in flight

Every number on the bar comes from the progress model (progress.py: tokens generated over
the recent window, ETA from the rows left): tqdm draws the bar and the line, fits it to the
terminal's width and leaves it on screen when closed, but its own rate and remaining-time
estimates are not shown, because they count only finished rows and would contradict the
model (rows finish in waves; tokens flow all the time). Without a row count there is no
bar, only the text; the count may come later (it runs beside the run), and the bar with it.

While the bar is up, log records that the root logger would print on the console (a
warning, a Ray replica's load time) are printed above it through tqdm, instead of being
written into the middle of its line; the handlers are put back when the bar closes.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from tokenmill.jobs.share_done import percent_done

__all__ = ["ProgressBar"]

_WITH_TOTAL = "{percent_done:3d}%|{bar}| {desc}"
_WITHOUT_TOTAL = "{desc}"


class _Bar(tqdm):
    """tqdm with ``percent_done`` for its format (tqdm's own ``percentage`` is rounded)."""

    @property
    def format_dict(self) -> dict[str, object]:
        values = super().format_dict
        values["percent_done"] = percent_done(int(self.n), int(self.total or 0))
        return values


class ProgressBar:
    """A bar on ``stream`` (a terminal) for ``total`` rows (None: not counted), starting at
    ``done`` rows (committed by earlier runs). ``show`` redraws it; ``close`` ends its line."""

    def __init__(self, stream: TextIO, total: int | None, done: int) -> None:
        self._bar = _Bar(
            total=total,
            initial=done,
            file=stream,
            unit="row",
            bar_format=_WITH_TOTAL if total else _WITHOUT_TOTAL,
            dynamic_ncols=True,
            mininterval=0,  # the caller decides when to redraw (once a sample, about 1 s)
            leave=True,
        )
        self._logs = contextlib.ExitStack()
        console = (sys.stdout, sys.stderr)
        if any(
            isinstance(h, logging.StreamHandler) and h.stream in console
            for h in logging.getLogger().handlers
        ):
            self._logs.enter_context(logging_redirect_tqdm())

    def show(self, done: int, text: str, total: int | None) -> None:
        """Redraw with ``done`` rows of ``total`` (counted or estimated: None, no bar) and
        ``text`` (rows, rate, ETA, as the model gives them)."""
        if total != self._bar.total:
            self._bar.total = total
            self._bar.bar_format = _WITH_TOTAL if total else _WITHOUT_TOTAL
        self._bar.n = done
        self._bar.set_description_str(text, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()
        self._logs.close()
