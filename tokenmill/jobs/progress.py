"""Progress: a bar on a terminal, plain periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("tokenmill.jobs")


class Progress:
    def __init__(
        self, total: int | None, already_done: int, enabled: bool = True, interval_s: float = 10.0
    ) -> None:
        self.total = total
        self.done = already_done
        self.done_this_run = 0
        self.tokens = 0
        self.samples: list[tuple[float, int]] = []  # (seconds, output tokens) for the report
        self.start = time.monotonic()
        self._last_log = self.start
        self.interval_s = interval_s
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=already_done, unit="row", dynamic_ncols=True)
        self.enabled = enabled

    def update(self, rows: int, tokens: int) -> None:
        self.done += rows
        self.done_this_run += rows
        self.tokens += tokens
        elapsed = time.monotonic() - self.start
        if not self.samples or elapsed - self.samples[-1][0] >= 1.0:
            self.samples.append((round(elapsed, 2), self.tokens))
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        if self._bar is not None:
            self._bar.update(rows)
            self._bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
        elif self.enabled and time.monotonic() - self._last_log >= self.interval_s:
            self._last_log = time.monotonic()
            log.info(
                "%s rows done%s, %.0f output tok/s%s",
                self.done,
                f" of {self.total}" if self.total else "",
                rate,
                self._eta(elapsed),
            )

    def _eta(self, elapsed: float) -> str:
        if not self.total or self.done_this_run <= 0:
            return ""
        rows_per_s = self.done_this_run / elapsed if elapsed > 0 else 0
        if rows_per_s <= 0:
            return ""
        return f", ETA {max(self.total - self.done, 0) / rows_per_s:.0f} s"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
