"""RowLengths: the output tokens the rows not yet finished will take, for the ETA.

The rows a run finishes first are its short ones (rows start together and the short ones
end first), so the mean of the finished rows' lengths is too small until the run is well
under way: with 1,024 rows a step it put the ETA at half the time left at 5% of the run,
a sixth with a mix of short and long answers. A row still generating is a length known to
be at least its tokens so far (a censored length, in survival analysis's words), so the
lengths are estimated as survival times (Kaplan-Meier): at each length j, the share of
the rows that reached j and ended there, from the finished rows and the rows still
generating alike.

    finished rows' lengths (a histogram) ──┐
    the rows in flight's tokens so far ────┴─► S(j) = P(a row runs past j tokens)
        a row not started: sum of S(j) over j < horizon
        a row in flight at c tokens: the sum of S(j) / S(c) over c <= j < horizon

``horizon``: the most tokens a row may take: the job's max_tokens, or the longest finished
row where that is longer (rows with a max_tokens of their own) or the job gives none. Unknown
(None) when a row in flight has run past it: nothing finished says how long such a row
goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["RowLengths"]


# Lengths are counted in bins of ``width`` tokens, the width doubling whenever the longest
# row would need more than this many: an estimate's cost stays ~0.1 ms however long rows
# run (32k-token rows, 8 completions each, cost 8 ms a sample counted token by token).
MAX_BINS = 4096


class RowLengths:
    """The finished rows' lengths, and the tokens the rest will take (module docstring)."""

    def __init__(self, horizon: int | None = None) -> None:
        self.horizon = horizon
        self.width = 1  # tokens a bin
        self._finished = np.zeros(64, dtype=np.int64)  # [b]: rows finished in bin b
        self._longest = 0

    def add(self, rows: int, tokens: int) -> None:
        """``rows`` rows finished with ``tokens`` between them (split evenly, to the token)."""
        if rows <= 0 or tokens <= 0:
            return
        each, extra = divmod(tokens, rows)
        self._count(each, rows - extra)
        self._count(each + 1, extra)

    def tokens_left(self, queued: int, running: Sequence[int]) -> float | None:
        """Tokens still to come: ``queued`` rows not started and the rows ``running`` with
        their tokens so far. None before any row finished, or when a running row has run
        past the horizon (module docstring; a finished row longer than the job's
        max_tokens, one with its own, moves the horizon to it)."""
        finished, width = self._finished, self.width  # (one read each: update() may grow it)
        if not finished.any():
            return None
        horizon = max(self.horizon or 0, self._longest)
        ran = np.asarray(running, dtype=np.int64)
        if len(ran) and int(ran.max()) > horizon:
            return None  # (one at the horizon is taken to end now)
        last = horizon // width  # the horizon's bin
        at = ran // width
        ended = np.zeros(last + 1, dtype=np.int64)
        ended[: min(len(finished), last + 1)] = finished[: last + 1]
        censored = np.bincount(at, minlength=last + 1)[: last + 1]
        # rows known to reach bin b: ended in it or later, or still running in it or later
        at_risk = np.cumsum((ended + censored)[::-1])[::-1]
        survive = np.cumprod(1.0 - ended / np.maximum(at_risk, 1))  # [b]: P(past bin b)
        # [b]: the sum of survive over b .. last - 1; a row running in bin b is past it
        # (survive[b] > 0: it is at risk there), so it has rest[b] / survive[b] bins to
        # come, and a row not started rest[0]
        rest = np.concatenate([np.cumsum(survive[:last][::-1])[::-1], [0.0]])
        running_left = rest[at] / survive[at]
        return (queued * float(rest[0]) + float(running_left.sum())) * width

    def _count(self, length: int, rows: int) -> None:
        if rows <= 0:
            return
        while length // self.width >= MAX_BINS:
            self._widen()
        index = length // self.width
        if index >= len(self._finished):
            grown = np.zeros(max(index + 1, 2 * len(self._finished)), dtype=np.int64)
            grown[: len(self._finished)] = self._finished
            self._finished = grown
        self._finished[index] += rows
        self._longest = max(self._longest, length)

    def _widen(self) -> None:
        """Bins twice as wide: each new bin holds two old ones."""
        old = self._finished
        if len(old) % 2:
            old = np.concatenate([old, [0]])
        self._finished = old[0::2] + old[1::2]
        self.width *= 2
