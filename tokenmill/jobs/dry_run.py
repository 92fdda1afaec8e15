"""--dry-run: validate the spec, read and tokenize every row, load no weights, write nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.core import hash_block_tokens
from tokenmill.engine.loader import resolve_model_source
from tokenmill.io.readers import iter_input_rows
from tokenmill.io.storage import OutputStore
from tokenmill.jobs.manifest import Manifest
from tokenmill.jobs.preflight import check_up_front, input_config, output_schema
from tokenmill.jobs.requests import prompt_ids_for, row_error_reason, sampling_params_for
from tokenmill.jobs.runner import fingerprint_of
from tokenmill.jobs.spec import JobSpec

MAX_EXAMPLES = 20
MAX_TRACKED_BLOCKS = 2_000_000  # bounds the memory of the shared-prefix estimate


@dataclass
class DryRunReport:
    job: str
    rows: int = 0
    bad_rows: int = 0
    bad_examples: list[tuple[str, str]] = field(default_factory=list)
    prompt_tokens: int = 0
    shared_prefix_tokens: int = 0
    rows_already_done: int = 0
    resumable: bool | None = None  # None: no earlier progress; False: fingerprint differs

    @property
    def shared_prefix_share(self) -> float:
        return self.shared_prefix_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> str:
        lines = [
            f"dry run of job {self.job}",
            f"  rows            {self.rows} ({self.bad_rows} bad)",
            f"  prompt tokens   {self.prompt_tokens}",
            f"  shared prefixes {self.shared_prefix_share:.1%} of prompt tokens "
            "(full KV blocks another row already has)",
            f"  already done    {self.rows_already_done} rows"
            + (
                " (earlier progress has another fingerprint: use --fresh)"
                if self.resumable is False
                else ""
            ),
        ]
        for row_id, reason in self.bad_examples:
            lines.append(f"  bad row {row_id}: {reason}")
        if self.bad_rows > len(self.bad_examples):
            lines.append(f"  ... and {self.bad_rows - len(self.bad_examples)} more bad rows")
        return "\n".join(lines)


def dry_run(spec: JobSpec) -> DryRunReport:
    """Read, check and tokenize every row as a run would; write nothing. Raises JobSpecError
    for what a run would refuse up front (output location, input, model)."""
    check_up_front(spec)
    fingerprint = fingerprint_of(spec)  # also checks model.source
    store = OutputStore(spec.output.path, dict(spec.output.storage_options))
    manifest = Manifest.load(store, spec.name)
    resumable = manifest is not None and manifest.fingerprint == fingerprint
    # The schema a run writes with: the one the job fixed, else the one a first run would fix.
    schema = manifest.output_schema if resumable and manifest is not None else None
    if schema is None:
        schema = output_schema(spec)
    source = resolve_model_source(spec.model.source)
    tokenizer = source.load_tokenizer()
    config = source.load_config()
    max_len = config.max_position_embeddings
    if spec.engine.max_model_len is not None:
        max_len = min(max_len, spec.engine.max_model_len)
    report = DryRunReport(job=spec.name)
    defaults: dict[str, Any] = spec.sampling.model_dump()
    block = spec.engine.block_size
    seen_blocks: set[int] = set()

    for row in iter_input_rows(input_config(spec), schema):
        report.rows += 1
        reason = row.error
        if reason is None:
            try:
                sampling_params_for(row, defaults)
                ids = prompt_ids_for(row, tokenizer)
                if len(ids) >= max_len:
                    reason = f"{len(ids)} prompt tokens exceed the context ({max_len})"
            except Exception as exc:  # as the run would: this row's error, not the job's
                reason = row_error_reason(exc)
        if reason is not None:
            report.bad_rows += 1
            if len(report.bad_examples) < MAX_EXAMPLES:
                report.bad_examples.append((row.row_id, f"{row.source}: {reason}"))
            continue
        report.prompt_tokens += len(ids)
        parent = None
        for start in range(0, len(ids) - block + 1, block):
            parent = hash_block_tokens(parent, tuple(ids[start : start + block]), ())
            if parent in seen_blocks:
                report.shared_prefix_tokens += block
            elif len(seen_blocks) < MAX_TRACKED_BLOCKS:
                seen_blocks.add(parent)

    if manifest is not None:
        report.resumable = resumable
        report.rows_already_done = manifest.rows_done if resumable else 0
    return report
