"""RowsInFlight: the rows an executor has in its engine, each as one or more engine requests.

An engine request makes one completion. A row asking for ``n`` completions (OpenAI's ``n``)
becomes n requests through ``sample_groups.py``, as ``LLM.generate`` expands them, added
together so the later ones reuse the prompt's cached KV blocks; its result waits for all n:

    row 7, n=3 ─► "7", "7.1", "7.2" ─► engine ─► outputs, any order ─┐
                                                                      ├─► gather ─► row 7's
                  finish("7.2"), finish("7"): None ... finish("7.1") ─┘    RequestOutput

A plain row is one request under its own id, as before.

``nbytes`` is about what the rows in flight hold (row_bytes.py): a row keeps its passthrough
values while its requests run, so the executor stops adding rows past a bound in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sample_groups import SampleGroup
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.io.rows import InputRow
from tokenmill.jobs.row_bytes import input_row_bytes

__all__ = ["FinishedRow", "RowsInFlight"]


@dataclass(frozen=True)
class FinishedRow:
    """A row whose requests have all finished: its output (the failed request's, if one
    failed), its sampling parameters and the tokens all its samples generated."""

    row: InputRow
    output: RequestOutput
    params: SamplingParams
    generated_tokens: int


@dataclass
class _Row:
    row: InputRow
    group: SampleGroup
    nbytes: int
    samples: dict[str, RequestOutput] = field(default_factory=dict)


class RowsInFlight:
    """Rows by engine request id; see the module docstring. Not thread-safe: the engine's
    thread owns it."""

    def __init__(self) -> None:
        self._by_request: dict[str, _Row] = {}
        self._rows = 0
        self.nbytes = 0  # about the bytes the rows in flight hold (input_row_bytes)

    def add(self, row: InputRow, group: SampleGroup) -> None:
        """Track ``row`` once all of ``group``'s requests are in the engine."""
        entry = _Row(row, group, input_row_bytes(row))
        for rid, _ in group.requests():
            self._by_request[rid] = entry
        self._rows += 1
        self.nbytes += entry.nbytes

    def finish(self, out: RequestOutput) -> FinishedRow | None:
        """Record a finished request; the row once its last request finished, else None.
        When one of a row's requests failed (``out.error``), that output is the row's.
        Raises KeyError for a request id that is not in flight."""
        entry = self._by_request.pop(out.request_id)
        entry.samples[out.request_id] = out
        if len(entry.samples) < entry.group.num_samples:
            return None
        self._rows -= 1
        self.nbytes -= entry.nbytes
        generated = sum(s.num_completion_tokens for s in entry.samples.values())
        failed = next((s for s in entry.samples.values() if s.error is not None), None)
        whole = failed if failed is not None else entry.group.gather(entry.samples)
        return FinishedRow(entry.row, whole, entry.group.params, generated)

    def row_tokens(self, unfinished: dict[str, int]) -> tuple[int, ...]:
        """Each row's output tokens so far: its finished samples' and, from ``unfinished``
        ({request id: tokens so far}, the engine's), the rest's."""
        rows: dict[int, int] = {}  # id(row entry): tokens
        for rid, entry in self._by_request.items():
            key = id(entry)
            if key not in rows:
                rows[key] = sum(s.num_completion_tokens for s in entry.samples.values())
            rows[key] += unfinished.get(rid, 0)
        return tuple(rows.values())

    def request_ids(self) -> list[str]:
        """The engine request ids still in flight (to abort them)."""
        return list(self._by_request)

    @property
    def num_requests(self) -> int:
        return len(self._by_request)

    def __len__(self) -> int:
        """Rows in flight (a row of n requests counts once)."""
        return self._rows

    def clear(self) -> None:
        self._by_request.clear()
        self._rows = 0
        self.nbytes = 0
