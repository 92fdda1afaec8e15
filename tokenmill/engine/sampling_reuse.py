"""The last step's SamplingMetadata, reused while the next steps sample the same rows.

Building the metadata is some fifty numpy calls a step whatever the batch size (0.15-0.35
ms on the host), yet between two steps that sample the same batch slots in the same order,
with no slot given to a new request since (``SamplingColumns.version``), it comes out the
same, unless it depends on the step itself:

    penalties        the output token counts grow every step
    seeded rows      a row's draw is seeded by its output position
    grammars         the allowed tokens follow the tokens sampled so far

Metadata with none of those is kept and handed out again. Its per-row columns are views of
the model runner's ``UploadRing``, valid for a few upload calls only: the first reuse copies
them into tensors of their own (a step later, while the views still hold), unless too many
uploads have gone by, which counts as a miss.

    step n     rows [3 7 9]   built, kept (views of ring call c)
    step n+1   rows [3 7 9]   reused: its columns copied out of the ring, kept
    step n+2   rows [3 7 9]   reused as it is
    step n+3   rows [3 9]     built (row 7 finished), kept
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tokenmill.engine.sampling_columns import SamplingColumns
from tokenmill.engine.sampling_metadata import SamplingMetadata
from tokenmill.engine.upload_ring import UploadRing

__all__ = ["SamplingReuse", "reusable"]


def reusable(meta: SamplingMetadata) -> bool:
    """Whether ``meta`` depends only on its rows' settings (see the module docstring)."""
    return meta.no_penalties and not meta.row_seeds and meta.allowed_token_rows is None


class SamplingReuse:
    """Keeps one step's metadata for the next steps of the same rows."""

    def __init__(self, ring: UploadRing) -> None:
        self._ring = ring
        self._columns: SamplingColumns | None = None
        self._version = -1
        self._rows = np.empty(0, dtype=np.int64)
        self._meta: SamplingMetadata | None = None
        self._call = 0  # the ring call the kept columns are views of; -1: they are its own

    def get(self, columns: SamplingColumns, rows: np.ndarray) -> SamplingMetadata | None:
        """The kept metadata if it was built for these ``rows`` (batch slots in logits-row
        order) of ``columns`` at their current version; else None (build it, then ``keep``)."""
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

    def keep(self, columns: SamplingColumns, rows: np.ndarray, meta: SamplingMetadata) -> None:
        """Offer ``meta``, just built for ``rows`` of ``columns`` with the ring's last upload
        holding its columns; kept only if ``reusable``."""
        if not reusable(meta):
            self._meta = None
            return
        self._columns, self._version = columns, columns.version
        self._rows = rows.copy()
        self._meta = meta
        self._call = self._ring.calls


def _own_columns(meta: SamplingMetadata) -> SamplingMetadata:
    """``meta`` with its per-row columns copied into tensors of their own (three copies)."""
    floats = torch.stack(
        [
            meta.temperature,
            meta.top_p,
            meta.min_p,
            meta.presence_penalty,
            meta.frequency_penalty,
            meta.repetition_penalty,
        ]
    )
    return dataclasses.replace(
        meta,
        temperature=floats[0],
        top_p=floats[1],
        min_p=floats[2],
        presence_penalty=floats[3],
        frequency_penalty=floats[4],
        repetition_penalty=floats[5],
        greedy=meta.greedy.clone(),
        top_k=meta.top_k.clone(),
    )
