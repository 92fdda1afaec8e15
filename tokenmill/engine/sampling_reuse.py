"""The last step's SamplingMetadata, reused while the next steps sample the same rows.

Building the metadata is some fifty numpy calls a step whatever the batch size (0.15-0.35
ms on the host), yet between two steps that sample the same batch slots in the same order,
with no slot given to a new request since (``SamplingColumns.version``), it comes out the
same, unless it depends on the step itself:

    penalties        the output token counts grow every step
    seeded rows      a row's draw is seeded by its output position
    min_tokens       a row short of it may not sample its stop tokens yet (min_tokens.py)

Metadata with neither is kept and handed out again. Rows with a grammar (structured output)
are kept too: which rows have one is a setting like the others, and only their masks are
the step's own (the model runner puts this step's in: ``with_token_bitmask``).

Kept metadata's per-row columns are views of the model runner's ``UploadRing``, valid for a
few upload calls only: the first reuse copies them into tensors of their own (a step later,
while the views still hold), unless too many uploads have gone by, which counts as a miss.

    step n     rows [3 7 9]   built, kept (views of ring call c)
    step n+1   rows [3 7 9]   reused: its columns copied out of the ring, kept
    step n+2   rows [3 7 9]   reused as it is
    step n+3   rows [3 9]     built (row 7 finished), kept

When every row of a step samples alike (one ``SamplingColumns.setting_ids`` value, as in a
job whose rows override nothing), the metadata does not depend on which rows they are, only
on how many: the widest such metadata built so far is kept per setting (its columns copied
at once), and a step of that setting with at most as many rows gets its first rows, views,
whichever slots it samples. With natural EOS some row finishes in nearly every step, so
the same-rows reuse above rarely holds there, and this one does:

    step n     rows [3 7 9]   all setting 0: built, kept for setting 0 (3 rows)
    step n+1   rows [3 9]     row 7 finished: the first 2 rows of the kept one
    step n+2   rows [3 9 4]   row 4 joined, setting 0: the kept one again (3 rows)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tokenmill.engine.sampling_columns import NO_SETTING_ID, SamplingColumns
from tokenmill.engine.sampling_metadata import SamplingMetadata
from tokenmill.engine.upload_ring import UploadRing

__all__ = ["SamplingReuse", "reusable"]

_MAX_CUTS = 4096  # (setting, row count) metadata views kept; a batch size needs one each


def reusable(meta: SamplingMetadata) -> bool:
    """Whether ``meta`` depends only on its rows' settings (see the module docstring)."""
    return meta.no_penalties and not meta.row_seeds and not meta.bans_stop_tokens


class SamplingReuse:
    """Keeps one step's metadata for the next steps of the same rows."""

    def __init__(self, ring: UploadRing) -> None:
        self._ring = ring
        self._columns: SamplingColumns | None = None
        self._version = -1
        self._rows = np.empty(0, dtype=np.int64)
        self._meta: SamplingMetadata | None = None
        self._call = 0  # the ring call the kept columns are views of; -1: they are its own
        self._alike: dict[int, SamplingMetadata] = {}  # setting id -> widest, own columns
        self._alike_columns: SamplingColumns | None = None  # whose setting ids those are
        self._cut: dict[tuple[int, int], SamplingMetadata] = {}  # (setting, rows) -> first rows

    def get(self, columns: SamplingColumns, rows: np.ndarray) -> SamplingMetadata | None:
        """Kept metadata for these ``rows`` (batch slots in logits-row order) of ``columns``:
        the one built for the same rows at the columns' current version, or the first rows
        of one kept for their common setting; else None (build it, then ``keep``)."""
        meta = self._same_rows(columns, rows)
        return meta if meta is not None else self._alike_rows(columns, rows)

    def keep(
        self, columns: SamplingColumns, rows: np.ndarray, meta: SamplingMetadata, version: int
    ) -> None:
        """Offer ``meta``, just built for ``rows`` of ``columns`` at ``version`` (the columns'
        version when their rows were gathered), with the ring's last upload holding its
        columns; kept only if ``reusable`` and no row was set since: the build fills a
        step's grammar masks, beside which the engine may give a finished request's slot to
        a new one, whose settings ``meta`` does not hold."""
        if not reusable(meta) or columns.version != version:
            self._meta = None
            return
        self._columns, self._version = columns, columns.version
        self._rows = rows.copy()
        self._meta = meta
        self._call = self._ring.calls
        setting = _common_setting(columns, rows)
        if setting == NO_SETTING_ID:
            return
        if columns is not self._alike_columns:
            self._alike, self._alike_columns, self._cut = {}, columns, {}
        widest = self._alike.get(setting)
        if widest is None or widest.num_rows < meta.num_rows:
            self._meta = self._alike[setting] = _own_columns(meta)
            self._call = -1
            self._cut = {k: v for k, v in self._cut.items() if k[0] != setting}

    def _same_rows(self, columns: SamplingColumns, rows: np.ndarray) -> SamplingMetadata | None:
        meta = self._meta
        if (
            meta is None
            or columns is not self._columns
            or columns.version != self._version
            or not np.array_equal(rows, self._rows)
        ):
            return None
        if self._call >= 0:
            if not self._ring.views_valid(self._call):
                self._meta = None
                return None
            meta = self._meta = _own_columns(meta)
            self._call = -1
        return meta

    def _alike_rows(self, columns: SamplingColumns, rows: np.ndarray) -> SamplingMetadata | None:
        if columns is not self._alike_columns or not self._alike:
            return None
        setting = _common_setting(columns, rows)
        cut = self._cut.get((setting, len(rows)))
        if cut is not None:
            return cut
        widest = self._alike.get(setting)
        if widest is None or widest.num_rows < len(rows):
            return None
        if len(self._cut) >= _MAX_CUTS:
            self._cut.clear()
        cut = self._cut[setting, len(rows)] = _first_rows(widest, len(rows))
        return cut


def _common_setting(columns: SamplingColumns, rows: np.ndarray) -> int:
    """The setting id all ``rows`` share, or NO_SETTING_ID (none shared, or no rows)."""
    if not len(rows):
        return NO_SETTING_ID
    ids = columns.setting_ids[rows]
    first = int(ids[0])
    return first if (ids == first).all() else NO_SETTING_ID


# SamplingMetadata's per-row columns (one value per logits row); every other field holds
# for any rows that sample alike.
_FLOAT_COLUMNS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_PER_ROW_COLUMNS = (*_FLOAT_COLUMNS, "greedy", "top_k")


def _first_rows(meta: SamplingMetadata, n: int) -> SamplingMetadata:
    """``meta`` (rows that all sample alike, reusable, no logit bias) for its first ``n``
    rows: its per-row columns cut to views."""
    if n == meta.num_rows:
        return meta
    cut = {name: getattr(meta, name)[:n] for name in _PER_ROW_COLUMNS}
    if meta.allowed_token_rows is not None:  # rows alike: all have a grammar, 0..n-1
        cut["allowed_token_rows"] = meta.allowed_token_rows[:n]
    return dataclasses.replace(meta, num_rows=n, **cut)


def _own_columns(meta: SamplingMetadata) -> SamplingMetadata:
    """``meta`` with its per-row columns copied into tensors of their own (the float ones
    stacked into one: three copies)."""
    floats = torch.stack([getattr(meta, name) for name in _FLOAT_COLUMNS])
    own = {name: floats[i] for i, name in enumerate(_FLOAT_COLUMNS)}
    own |= {name: getattr(meta, name).clone() for name in _PER_ROW_COLUMNS if name not in own}
    return dataclasses.replace(meta, **own)
