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

``horizon``: the most tokens a row may take (the job's max_tokens); without it, the longest
finished row. Unknown (None) when a row in flight has run past the horizon (rows with a
max_tokens of their own): nothing finished says how long such a row goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["RowLengths"]


class RowLengths:
    """The finished rows' lengths, and the tokens the rest will take (module docstring)."""

    def __init__(self, horizon: int | None = None) -> None:
        self.horizon = horizon
        self._finished = np.zeros(64, dtype=np.int64)  # [j]: rows finished with j tokens
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
        past the horizon (module docstring)."""
        if not self._finished.any():
            return None
        horizon = self.horizon if self.horizon is not None else self._longest
        ran = np.asarray(running, dtype=np.int64)
        if len(ran) and int(ran.max()) > horizon:
            return None  # (one at the horizon is taken to end now)
        size = max(horizon, self._longest) + 1
        ended = np.zeros(size, dtype=np.int64)
        ended[: len(self._finished)] = self._finished[:size]
        censored = np.bincount(ran, minlength=size)[:size]
        # rows known to reach j: ended at j or later, or still running at j or later
        at_risk = np.cumsum((ended + censored)[::-1])[::-1]
        survive = np.cumprod(1.0 - ended / np.maximum(at_risk, 1))  # [j]: P(length > j)
        # [c]: the sum of survive[j] over c <= j < horizon; a row running at c tokens has
        # length > c, so it has rest[c] / survive[c] to come, and a row not started rest[0]
        rest = np.concatenate([np.cumsum(survive[:horizon][::-1])[::-1], [0.0]])
        running_left = rest[ran] / survive[ran]  # (survive[c] > 0: the row is at risk to c)
        return queued * float(rest[0]) + float(running_left.sum())

    def _count(self, length: int, rows: int) -> None:
        if rows <= 0:
            return
        if length >= len(self._finished):
            grown = np.zeros(max(length + 1, 2 * len(self._finished)), dtype=np.int64)
            grown[: len(self._finished)] = self._finished
            self._finished = grown
        self._finished[length] += rows
        self._longest = max(self._longest, length)
