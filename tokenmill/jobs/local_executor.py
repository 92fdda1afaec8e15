"""The local executor: one engine in this process, fed as a stream.

Rows are added while fewer than ``2 * max_num_seqs`` are in flight, so the scheduler always
has a queue to batch from, and results are yielded as requests finish (any order).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from tokenmill.engine.engine_config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.requests import (
    error_result,
    prompt_ids_for,
    result_from_output,
    row_error_reason,
    sampling_params_for,
)
from tokenmill.jobs.spec import JobSpec


def engine_config(spec: JobSpec) -> EngineConfig:
    """The EngineConfig of ``spec``: model.source and model.dtype, then the engine section
    (EngineConfig's defaults for the fields a job does not set)."""
    return EngineConfig(model=spec.model.source, dtype=spec.model.dtype, **spec.engine.model_dump())


class RowProcessor:
    """One engine and the row <-> request mapping; used by the local and the Ray executor."""

    def __init__(self, spec: JobSpec) -> None:
        self.engine = LLMEngine(engine_config(spec))
        self.tokenizer = self.engine.tokenizer
        self.model_name = spec.model.source
        self.sampling_defaults: dict[str, Any] = spec.sampling.model_dump()
        self.max_in_flight = 2 * spec.engine.max_num_seqs

    def process(
        self, rows: Iterable[InputRow], cancel: threading.Event | None = None
    ) -> Iterator[ResultRow]:
        """Run good rows through the engine; yields one ResultRow per row. On ``cancel``,
        in-flight requests are dropped (their rows yield nothing) and the stream ends."""
        cancel = cancel or threading.Event()
        in_flight: dict[str, InputRow] = {}
        source = iter(rows)
        exhausted = False
        while True:
            while not exhausted and len(in_flight) < self.max_in_flight and not cancel.is_set():
                row = next(source, None)
                if row is None:
                    exhausted = True
                    break
                try:
                    ids = prompt_ids_for(row, self.tokenizer)
                    params = sampling_params_for(row, self.sampling_defaults)
                    rid = str(row.row_index)
                    self.engine.add_request(rid, ids, params)
                    in_flight[rid] = row
                except Exception as exc:  # templating, tokenizing, parameters: the row's error
                    yield error_result(row, row_error_reason(exc), self.model_name)
            if cancel.is_set():
                self.engine.abort_requests(list(in_flight))
                return
            if not self.engine.has_unfinished():
                if exhausted:
                    return
                continue
            for out in self.engine.step():
                row = in_flight.pop(out.request_id)
                yield result_from_output(row, out, self.tokenizer, self.model_name)

    @property
    def prefix_stats(self) -> tuple[int, int]:
        """(queried prompt tokens, prefix-cache hit tokens) so far."""
        stats = self.engine.scheduler.kv.prefix_cache_stats
        return stats.queried_tokens, stats.hit_tokens

    def close(self) -> None:
        """Release the engine's memory (the KV cache) promptly."""
        self.engine = None  # type: ignore[assignment]
