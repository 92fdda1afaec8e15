"""--dry-run: validate the spec, read and tokenize every row, load no weights, write nothing;
then say how much work the job is and about how long it will take.

    every row ─► the checks a run makes (bad rows, with examples)
    good rows ─► PromptStats: prompt tokens, shared-prefix share, duplicates, output tokens
    output tokens / the measured rate of the nearest throughput-table entry ─► estimated time

Rows are streamed, never held: memory is bounded by the sets PromptStats caps (shared-prefix
blocks, distinct rows) whatever the input's size. The time is an estimate: output tokens
counted as if every row ran to max_tokens (an upper bound unless ignore_eos), over a rate a
benchmark measured on its own workload (throughput_table.py, which says how the job differs).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.loader import resolve_model_source
from tokenmill.engine.model_config import ModelConfig, context_limit
from tokenmill.engine.prompts import check_prompt_ids
from tokenmill.engine.sampling_params import check_vocab_ids
from tokenmill.io.readers import iter_input_rows
from tokenmill.io.storage import OutputStore
from tokenmill.jobs.fingerprint import (
    changed_settings,
    fingerprint,
    settings_record,
)
from tokenmill.jobs.local_executor import engine_config
from tokenmill.jobs.manifest import Manifest
from tokenmill.jobs.output_links import check_no_links
from tokenmill.jobs.ownership import check_claimable, check_not_inside_another
from tokenmill.jobs.preflight import check_up_front, output_schema
from tokenmill.jobs.progress import format_duration
from tokenmill.jobs.prompt_stats import PromptStats
from tokenmill.jobs.ready_rows import RowPreparer
from tokenmill.jobs.requests import (
    check_output_holds,
    check_row_constraint,
    prompt_ids_for,
    row_error_reason,
    sampling_params_for,
)
from tokenmill.jobs.runner import settings_of
from tokenmill.jobs.shard_size import with_shard_size
from tokenmill.jobs.spec import JobSpec
from tokenmill.jobs.stop_signals import JobInterrupted
from tokenmill.jobs.throughput_table import Estimate, estimate_time, model_params

log = logging.getLogger("tokenmill.jobs")

MAX_EXAMPLES = 20
PROGRESS_EVERY_S = 10.0  # a line while it reads: 1M rows take minutes
MAX_TRACKED_BLOCKS = 2_000_000  # bounds the memory of the shared-prefix estimate (~140 MB)
MAX_TRACKED_ROWS = 1_000_000  # duplicates are exact up to this many distinct rows (~70 MB)


@dataclass
class DryRunReport:
    job: str
    rows: int = 0
    bad_rows: int = 0
    bad_examples: list[tuple[str, str]] = field(default_factory=list)
    prompt_tokens: int = 0
    longest_prompt: int = 0
    shared_prefix_tokens: int = 0
    shared_prefix_capped: bool = False  # past MAX_TRACKED_BLOCKS: the share is a lower bound
    block_size: int = 16
    duplicate_rows: int = 0  # same prompt tokens and sampling settings as an earlier row
    duplicate_error: int = 0  # one standard error; 0: an exact count
    output_tokens: int = 0  # at most (every row to max_tokens); exact when all ignore_eos
    output_tokens_exact: bool = False
    estimate: Estimate | None = None
    rows_already_done: int = 0
    resumable: bool | None = None  # None: no earlier progress; False: fingerprint differs
    changed: list[str] = field(default_factory=list)  # what differs (changed_settings)

    @property
    def shared_prefix_share(self) -> float:
        return self.shared_prefix_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> str:
        good = self.rows - self.bad_rows
        mean = f"mean {self.prompt_tokens / good:,.0f}, " if good else ""
        lines = [
            f"dry run of job {self.job}",
            f"  rows            {self.rows} ({self.bad_rows} bad)",
            f"  prompt tokens   {self.prompt_tokens} ({mean}longest {self.longest_prompt})",
            f"  shared prefixes {self.shared_prefix_share:.1%} of prompt tokens "
            f"(full KV blocks of {self.block_size} tokens an earlier row already has"
            + (
                "; at least: too many blocks to track them all)"
                if self.shared_prefix_capped
                else ")"
            ),
            f"  duplicates      {self._duplicates()}",
            f"  output tokens   {self._output_tokens()}",
            *self._estimate_lines(),
            f"  already done    {self.rows_already_done} rows"
            + (
                " (earlier progress has another fingerprint: use --fresh)"
                if self.resumable is False
                else ""
            ),
            *(f"  changed since   {change}" for change in self.changed),
        ]
        if self.rows_already_done:
            lines.insert(
                3,
                "  (prompt tokens, shared prefixes, duplicates, output tokens and the estimate "
                "count the rows not done yet)",
            )
        for row_id, reason in self.bad_examples:
            lines.append(f"  bad row {row_id}: {reason}")
        if self.bad_rows > len(self.bad_examples):
            lines.append(f"  ... and {self.bad_rows - len(self.bad_examples)} more bad rows")
        return "\n".join(lines)

    def _duplicates(self) -> str:
        n = self.duplicate_rows
        if self.duplicate_error:
            count = f"about {n:,} (± {self.duplicate_error:,}, a HyperLogLog estimate)"
        else:
            count = f"{n:,}"
        return f"{count} rows repeat an earlier row's prompt and sampling settings"

    def _output_tokens(self) -> str:
        if self.output_tokens_exact:
            return f"{self.output_tokens:,} (every row runs to max_tokens: ignore_eos)"
        return f"at most {self.output_tokens:,} (each row's max_tokens; rows that end sooner, less)"

    def _estimate_lines(self) -> list[str]:
        est = self.estimate
        if est is None:
            return []
        e = est.entry
        duration = format_duration(est.seconds)
        if est.seconds < 0.5:  # "0 s" would read as nothing to do
            duration = "less than 1 s"
        what = "GPU time" if e.device == "gpu" else "CPU time"
        if not self.output_tokens_exact:
            what += " with every row to max_tokens"
        pad = " " * 18
        lines = [
            f"  estimate        {duration} of {what}, an estimate: "
            f"{est.output_tokens:,} output tokens / {e.output_tokens_per_s:,} output tok/s",
            f"{pad}the rate of entry {e.name} (throughput_table.json), measured for "
            f'BENCHMARKS.md, section "{e.source}"',
            f"{pad}measured with: {e.model}, {e.hardware}, {e.dtype}; {e.workload}",
        ]
        if est.replicas > 1:
            lines.append(
                f"{pad}{est.replicas} replicas: about "
                f"{format_duration(est.wall_seconds)} of wall time"
            )
        lines += [f"{pad}note: {note}" for note in est.notes]
        if self.prompt_tokens > _PROMPT_HEAVY * max(est.output_tokens, 1):
            lines.append(
                f"{pad}note: the prompts hold {self.prompt_tokens / max(est.output_tokens, 1):,.0f}"
                "x the output tokens; reading them is not in this rate (its workload's "
                "prompts were at most about as long as its outputs): expect longer"
            )
        return lines


# Prompt tokens per output token past which the estimate says its rate leaves prefill out.
_PROMPT_HEAVY = 4


def dry_run(
    spec: JobSpec, cancel: threading.Event | None = None, fresh: bool = False
) -> DryRunReport:
    """Read, check and tokenize every row as a run would; write nothing. Raises JobSpecError
    for what a run would refuse up front (output location, input, model), and JobInterrupted
    once ``cancel`` is set (a stop signal: with nothing to commit, a dry run stops at once).
    ``fresh``: as a ``--fresh`` run would, counting none of the output's earlier progress."""
    cfg = check_up_front(spec)  # with the files the verdicts below all see
    store = OutputStore(spec.output.path, dict(spec.output.storage_options))
    if store.is_local:
        check_no_links(store.root)  # a link inside a local output: refused, as a run would
    check_not_inside_another(store, spec.name)  # refused, as a run refuses them: inside
    check_claimable(store, spec.name)  # another job's output, or that output itself
    manifest = None if fresh else Manifest.load(store, spec.name)
    if manifest is not None and not manifest.shards and not manifest.complete:
        manifest = None  # no progress to mix: a run starts over (runner._run_locked)
    if manifest is not None:  # the count a run's fingerprint covers
        spec = with_shard_size(spec, None, manifest)
    # Once, as a run does (it hashes every input file's edges and reads the model's config),
    # with the manifest's settings: the fingerprint of a model moved since is an earlier one.
    kept = None if manifest is None else manifest.settings
    settings, earlier = settings_of(spec, cfg, kept)  # also checks model.source
    resumable = manifest is not None and manifest.matches(
        fingerprint(settings), settings_record(settings), earlier
    )  # as a run decides
    # The schema a run writes with: the one the job fixed, else the one a first run would fix.
    schema = manifest.output_schema if resumable and manifest is not None else None
    if schema is None:
        schema = output_schema(spec, cfg)
    source = resolve_model_source(spec.model.source)
    tokenizer = source.load_tokenizer()
    config = source.load_config()
    max_len, _ = context_limit(config)  # as the engine: a sliding window bounds it
    if spec.engine.max_model_len is not None:
        max_len = min(max_len, spec.engine.max_model_len)
    report = DryRunReport(job=spec.name, block_size=spec.engine.block_size)
    schema_prompt_logprobs = schema is not None and schema.has_prompt_logprobs
    schema_logprobs = schema is not None and schema.has_logprobs
    defaults: dict[str, Any] = spec.sampling.model_dump()
    stats = PromptStats(spec.engine.block_size, MAX_TRACKED_BLOCKS, MAX_TRACKED_ROWS)

    chat = spec.model.chat()
    backend = spec.engine.structured_output_backend
    preparer = RowPreparer(tokenizer, defaults, spec.model.source, max_len, chat)
    # Rows of committed shards count as rows (good or bad) but not as work left.
    done = set(manifest.shards) if resumable and manifest is not None else set()
    rows_per_shard = manifest.rows_per_shard if manifest is not None else 1
    started = shown = time.monotonic()
    for row in iter_input_rows(cfg, schema):
        if cancel is not None and cancel.is_set():
            raise JobInterrupted(f"the dry run stopped after {report.rows:,} rows")
        report.rows += 1
        if time.monotonic() - shown >= PROGRESS_EVERY_S:
            shown = time.monotonic()
            log.info(
                "dry run: %s rows read (%s bad) in %s",
                f"{report.rows:,}",
                f"{report.bad_rows:,}",
                format_duration(shown - started),
            )
        reason = row.error
        if reason is None:
            try:
                params = sampling_params_for(row, defaults)
                check_output_holds(
                    params, spec.output.format, schema_prompt_logprobs, schema_logprobs
                )
                check_vocab_ids(params, config.vocab_size)
                check_row_constraint(row, params, backend, spec.input.structured_output_column)
                reason = preparer.length_refusal(row)  # as a run: before tokenizing it
                if reason is not None:
                    raise ValueError(reason)
                ids = prompt_ids_for(row, tokenizer, chat)
                check_prompt_ids(ids, config.vocab_size)
                if len(ids) >= max_len:
                    reason = f"{len(ids)} prompt tokens exceed the context ({max_len})"
            except Exception as exc:  # as the run would: this row's error, not the job's
                reason = row_error_reason(exc)
        if reason is not None:
            report.bad_rows += 1
            if len(report.bad_examples) < MAX_EXAMPLES:
                report.bad_examples.append((row.row_id, f"{row.source}: {reason}"))
            continue
        if row.row_index // rows_per_shard in done:  # committed: a run computes it no more
            continue
        stats.add(ids, params, max_len)

    _fill_stats(report, stats)
    report.estimate = _estimate(spec, stats.max_output_tokens, stats.sequences, config)

    if manifest is not None:
        report.resumable = resumable
        report.rows_already_done = manifest.rows_done if resumable else 0
        if not resumable and manifest.settings is not None:
            report.changed = changed_settings(manifest.settings, settings_record(settings))
    return report


def _fill_stats(report: DryRunReport, stats: PromptStats) -> None:
    report.prompt_tokens = stats.prompt_tokens
    report.longest_prompt = stats.longest_prompt
    report.shared_prefix_tokens = stats.shared_prefix_tokens
    report.shared_prefix_capped = stats.prefix_capped
    report.duplicate_rows, report.duplicate_error = stats.duplicates
    report.output_tokens = stats.max_output_tokens
    report.output_tokens_exact = stats.all_ignore_eos and stats.rows > 0


def _estimate(spec: JobSpec, output_tokens: int, sequences: int, config: ModelConfig) -> Estimate:
    """The time estimate for the device the job would run on: engine.device, a GPU when one
    is visible here (auto), and for Ray replicas a GPU (they run on the cluster's nodes);
    ``sequences``: the good rows' completions (a row of n is n sequences in a step), shared
    evenly by the replicas."""
    import torch

    gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    device = spec.engine.device
    if device == "auto":
        device = "gpu" if gpu_name or spec.execution.executor == "ray" else "cpu"
    else:
        device = "cpu" if device == "cpu" else "gpu"
    # the dtype the engine would choose there (auto: fp32 on CPU, the checkpoint's on GPUs)
    target = torch.device("cpu" if device == "cpu" else "cuda")
    dtype = str(engine_config(spec).resolve_dtype(config, target)).removeprefix("torch.")
    replicas = spec.execution.replicas if spec.execution.executor == "ray" else 1
    in_flight = min(-(-sequences // replicas), spec.engine.max_num_seqs) if sequences else None
    return estimate_time(
        output_tokens,
        model_params(config),
        device,
        gpu_name,
        dtype,
        spec.model.quantization,
        replicas,
        rows_in_flight=in_flight,
    )
