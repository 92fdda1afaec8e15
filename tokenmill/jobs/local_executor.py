"""The local executor: one engine in this process, kept busy from a RowSource.

    source.take ─► add_request (up to 2 * max_num_seqs in flight) ─► step ─► ResultRows

The engine's batch never drains while there is input: before every step the executor tops
the engine up to ``2 * max_num_seqs`` requests (a row asking for n completions is n of them:
rows_in_flight.py), and no further once its rows hold ``max_in_flight_bytes`` (wide rows keep
their passthrough values in flight: 512 rows of 5 MB could hold 2.5 GB), from what the
source has ready, without waiting (it waits only when the engine has nothing to do), so the
scheduler always has a queue to batch from and the queued-but-not-running requests stay
bounded. Results are
yielded as requests finish (any order); ``on_step`` is called after every step (and at
every wait for rows), so the runner's progress can show tokens before any row finishes
(``live``), and keeps showing while no row comes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator

from tokenmill.engine.engine_config import EngineConfig
from tokenmill.engine.frozen_heap import frozen_heap
from tokenmill.engine.llm_engine import ContextCutError as EngineContextCut
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.sample_groups import SampleGroup
from tokenmill.engine.short_gil_turns import short_gil_turns
from tokenmill.io.rows import InputRow, ResultRow
from tokenmill.jobs.engine_counters import EngineCounters
from tokenmill.jobs.pipeline_bounds import PipelineBounds
from tokenmill.jobs.progress import LiveCounts
from tokenmill.jobs.ready_rows import RowPreparer, own_tokenizer
from tokenmill.jobs.requests import (
    check_output_holds,
    check_row_constraint,
    error_result,
    result_from_output,
    row_error_reason,
)
from tokenmill.jobs.row_source import FeedItem, RowList, RowSource
from tokenmill.jobs.rows_in_flight import RowsInFlight
from tokenmill.jobs.spec import JobSpec

log = logging.getLogger("tokenmill.jobs")


def engine_config(spec: JobSpec) -> EngineConfig:
    """The EngineConfig of ``spec``: model.source, model.dtype and model.quantization, then
    the engine section (EngineConfig's defaults for the fields a job does not set)."""
    return EngineConfig(
        model=spec.model.source,
        dtype=spec.model.dtype,
        quantization=spec.model.quantization,
        **spec.engine.model_dump(),
    )


class ContextCutError(ValueError):
    """The KV cache holds less than the job's context (``_load_engine``)."""


def _load_engine(spec: JobSpec) -> LLMEngine:
    """The job's engine; ContextCutError where the KV cache holds less than the context the
    job's settings give: its rows would be cut where memory decides (an engine lowers
    max_model_len to fit), and a resume with other memory or on another device would cut
    others elsewhere, so one job's output would mix the two without a word. The engine
    refuses before it allocates the cache and logs no lowering: the job does not run."""
    try:
        return LLMEngine(engine_config(spec), lower_context=False)
    except EngineContextCut as exc:
        held, wanted = exc.held, exc.wanted
    raise ContextCutError(
        f"engine: the KV cache holds {held} tokens, less than the {wanted}-token context the "
        f"job's settings give (engine.max_model_len, else the model's); rows would be cut "
        f"at a length this machine's memory decides. Set engine.max_model_len to {held} or "
        "less (a setting of the job: a resume keeps it), or raise engine.kv_cache_memory"
    )


class RowProcessor:
    """One engine and the row <-> request mapping; used by the local and the Ray executor.

    ``prepare`` turns rows into requests with a tokenizer of its own (it runs on the
    runner's reader thread while the engine decodes with the engine's)."""

    def __init__(self, spec: JobSpec) -> None:
        self.engine = _load_engine(spec)
        self.tokenizer = self.engine.tokenizer
        self.max_in_flight = 2 * spec.engine.max_num_seqs
        self.max_in_flight_bytes = PipelineBounds.for_engine(spec.engine.max_num_seqs).engine_bytes
        self.prepare = RowPreparer(
            own_tokenizer(self.tokenizer),
            spec.sampling.model_dump(),
            spec.model.source,
            self.engine.max_model_len,
            spec.model.chat(),
        )
        self.prepare.warm_up()  # part of the load: the first rows then run at full speed
        self.output_format = spec.output.format
        self.grammar_backend = spec.engine.structured_output_backend
        self.constraint_column = spec.input.structured_output_column
        # Parquet output has these columns when the job asks (preflight.output_schema)
        self.prompt_logprobs_column = spec.sampling.prompt_logprobs is not None
        self.logprobs_column = spec.sampling.logprobs is not None
        self._in_flight = RowsInFlight()
        self._returned_tokens = 0  # output tokens of the engine's outputs yielded so far
        self._finishing = 0  # rows finished by the last step, not yielded yet
        self._output_tokens = 0  # the highest count ``output_tokens`` gave

    @property
    def model_name(self) -> str:
        """The model's name in results (the spec's own spelling of model.source)."""
        return self.prepare.model

    @model_name.setter
    def model_name(self, name: str) -> None:
        self.prepare.model = name

    def process(
        self,
        rows: RowSource | Iterable[InputRow],
        cancel: threading.Event | None = None,
        on_step: Callable[[], None] | None = None,
    ) -> Iterator[ResultRow]:
        """Run the rows through the engine; yields one ResultRow per row. ``rows`` is a
        RowSource, or good InputRows (prepared here). On ``cancel``, in-flight requests are
        dropped (their rows yield nothing) and the stream ends. ``on_step`` is called after
        every engine step, and after every wait for rows while the engine has none.
        Re-raises the source's error."""
        cancel = cancel or threading.Event()
        source = rows if isinstance(rows, RowSource) else RowList(rows, self.prepare)
        # no full garbage collection stalls a step; the reader and writer threads hand the
        # GIL back within 0.5 ms (short_gil_turns.py)
        with frozen_heap(), short_gil_turns():
            yield from self._run(source, cancel, on_step)

    def _run(
        self, source: RowSource, cancel: threading.Event, on_step: Callable[[], None] | None
    ) -> Iterator[ResultRow]:
        in_flight = self._in_flight
        try:
            while not cancel.is_set():
                busy = self.engine.has_unfinished()
                room = self.max_in_flight - in_flight.num_requests
                full = len(in_flight) > 0 and in_flight.nbytes >= self.max_in_flight_bytes
                if room > 0 and not full and not source.exhausted:
                    for item in source.take(room, wait=not busy):
                        failed = self._add(item, in_flight)
                        if failed is not None:
                            yield failed
                    busy = self.engine.has_unfinished()
                if not busy:
                    if source.exhausted:
                        return
                    # Waiting for rows (a resume's reader skipping committed shards, a slow
                    # input): progress is due all the same (no line came for as long as the
                    # skip took: minutes on a long job's resume; an audit)
                    if on_step is not None:
                        on_step()
                    continue
                outputs = self.engine.step()
                # Before on_step's sample: the engine no longer counts these requests' tokens
                # (the live count stood still for a sample, then jumped: report.html's plot),
                # and the rows they finish are out of the rows in flight, counted as
                # finishing until each is yielded (a sample then counts every row once).
                self._returned_tokens += sum(out.num_completion_tokens for out in outputs)
                # Counted per request: a row of n requests is done once its last is.
                finished = [done for out in outputs if (done := in_flight.finish(out)) is not None]
                self._finishing = len(finished)
                if on_step is not None:
                    on_step()
                for done in finished:
                    self._finishing -= 1
                    yield result_from_output(
                        done.row,
                        done.output,
                        self.tokenizer,
                        self.model_name,
                        done.params.skip_special_tokens,
                        token_bytes_too=self.output_format == "openai-batch",
                        generated_tokens=done.generated_tokens,
                    )
        finally:  # a cancel, an error, or a stream closed early: no request stays behind
            self._finishing = 0  # (rows not yielded by then are not results of this run)
            self._drop(in_flight)

    def _drop(self, in_flight: RowsInFlight) -> None:
        """Abort ``in_flight``'s requests in the engine (their KV blocks and batch slots go
        back; the step they were cut in is forgotten: ``LLMEngine.cut_short``) and forget
        them. A failure here is logged, not raised: the caller is already leaving with the
        run's own outcome, which it must not replace."""
        try:
            if self.engine is not None and in_flight.num_requests:
                _ = self.output_tokens  # counts the dropped requests' tokens, kept from now
                self.engine.cut_short(in_flight.request_ids())
        except Exception:
            log.warning("could not abort the engine's requests of a stopped run", exc_info=True)
        in_flight.clear()

    def _add(self, item: FeedItem, in_flight: RowsInFlight) -> ResultRow | None:
        """Queue ``item``'s requests in the engine (one per completion it asks for); the
        row's error result when it cannot run."""
        if isinstance(item, InputRow):  # from a source that does not prepare its rows
            item = self.prepare([item])[0]
        if isinstance(item, ResultRow):  # it failed while being prepared
            return item
        group = SampleGroup.of(str(item.row.row_index), item.params)
        added: list[str] = []
        try:  # too long for the context, ids outside the vocabulary: the row's error
            check_output_holds(
                item.params, self.output_format, self.prompt_logprobs_column, self.logprobs_column
            )
            check_row_constraint(
                item.row, item.params, self.grammar_backend, self.constraint_column
            )
            for rid, params in group.requests():
                self.engine.add_request(rid, item.prompt_ids, params)
                added.append(rid)
        except Exception as exc:
            self.engine.abort_requests(added)  # none in practice: one prompt, one verdict
            return error_result(item.row, row_error_reason(exc), self.model_name)
        in_flight.add(item.row, group)
        return None

    @property
    def max_model_len(self) -> int:
        """The engine's context: a row's prompt and output tokens together, at most."""
        return self.engine.max_model_len

    @property
    def output_tokens(self) -> int:
        """Output tokens generated so far: the finished rows' and those of the requests still
        generating. Never decreases (a finished request's tokens leave the engine's count a
        step before its result is yielded; an aborted one's are gone)."""
        live = self._returned_tokens + self.engine.num_unfinished_output_tokens
        self._output_tokens = max(self._output_tokens, live)
        return self._output_tokens

    def live(self) -> LiveCounts:
        """Tokens so far and rows in flight with each one's tokens, for the progress line
        (the engine's thread)."""
        row_tokens = self._in_flight.row_tokens(self.engine.unfinished_output_tokens())
        return LiveCounts(
            self.output_tokens,
            len(self._in_flight),
            row_tokens=row_tokens,
            rows_finishing=self._finishing,
            preemptions=self.engine.scheduler.stats.num_preemptions,
        )

    @property
    def counters(self) -> EngineCounters:
        """The engine's counts so far (prefix cache, speculative drafts, output tokens)."""
        return EngineCounters.of(self.engine, self.output_tokens)

    def close(self) -> None:
        """Stop the engine's output worker and release its memory (the KV cache) promptly."""
        if self.engine is not None:
            self.engine.close()
        self.engine = None  # type: ignore[assignment]
